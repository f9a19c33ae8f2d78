"""The JSON-schema bounds (llmesh.schema_bounds): every bounded keyword just under, at and
just over its limit, the recursion the grammar sampler cannot afford, the estimate of the
grammar against what the converter writes, and the walk on schemas far deeper than Python
recurses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llmesh.errors import InvalidArgument
from llmesh.schema_bounds import LIMITS, SchemaLimits, check_request_size, check_schema, grammar_estimate, text_depth
from llmesh.validation import check_request, rule
from llmesh.types import Message, Prompt, ResponseFormat, Sampling, Tool, Tools
from llmesh.v1 import common_pb2, gateway_pb2

from .work import calls_made

P = "response_format.json_schema.schema"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def refusal(schema: dict | str, limits: SchemaLimits = LIMITS) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        check_schema(schema if isinstance(schema, str) else json.dumps(schema), P, limits)
    return info.value


def ok(schema: dict | str, limits: SchemaLimits = LIMITS) -> None:
    check_schema(schema if isinstance(schema, str) else json.dumps(schema), P, limits)


def integers(n: int) -> list[str]:
    return [f"p{i}" for i in range(n)]


# keyword, the limit, a schema with the keyword's value n, the path the refusal names
VALUES = [
    ("minLength", LIMITS.max_length, lambda n: {"type": "string", "minLength": n}, ".minLength"),
    ("maxLength", LIMITS.max_length, lambda n: {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": n}}}, ".properties.a.maxLength"),
    ("minItems", LIMITS.max_items, lambda n: {"type": "array", "items": {"type": "integer"}, "minItems": n},
     ".minItems"),
    ("maxItems", LIMITS.max_items, lambda n: {"type": "array", "items": {"type": "integer"}, "maxItems": n},
     ".maxItems"),
    ("minProperties", LIMITS.max_object_size, lambda n: {"type": "object", "minProperties": n}, ".minProperties"),
    ("maxProperties", LIMITS.max_object_size, lambda n: {"type": "object", "maxProperties": n}, ".maxProperties"),
    ("pattern {0,n}", LIMITS.max_pattern_repeat, lambda n: {"type": "string", "pattern": f"^[a-z]{{0,{n}}}$"},
     ".pattern"),
    ("pattern {n}", LIMITS.max_pattern_repeat, lambda n: {"type": "string", "pattern": f"^(ab){{{n}}}$"},
     ".pattern"),
    ("pattern {n,}", LIMITS.max_pattern_repeat, lambda n: {"type": "string", "pattern": f"^x{{{n},}}$"},
     ".pattern"),
]
COUNTS = [
    ("enum", LIMITS.max_enum, lambda n: {"enum": list(range(n))}, ".enum"),
    ("properties", LIMITS.max_properties, lambda n: {
        "type": "object", "properties": {p: {"type": "integer"} for p in integers(n)}, "required": integers(n)},
     ".properties"),
    ("anyOf", LIMITS.max_branches, lambda n: {"anyOf": [{"const": i} for i in range(n)]}, ".anyOf"),
    ("oneOf", LIMITS.max_branches, lambda n: {"oneOf": [{"const": i} for i in range(n)]}, ".oneOf"),
    ("allOf", LIMITS.max_branches, lambda n: {"allOf": [{"properties": {f"p{i}": {"type": "integer"}}}
                                                        for i in range(n)]}, ".allOf"),
    ("prefixItems", LIMITS.max_branches, lambda n: {"type": "array", "prefixItems": [{"type": "integer"}] * n},
     ".prefixItems"),
    ("type list", LIMITS.max_branches, lambda n: {"type": ["string"] * n}, ".type"),
    ("pattern groups", LIMITS.max_pattern_groups, lambda n: {"type": "string",
                                                             "pattern": "^" + "(" * n + "a" + ")" * n + "$"},
     ".pattern"),
    ("$ref", LIMITS.max_refs, lambda n: {"type": "object", "$defs": {"i": {"type": "integer"}},
                                         "properties": {p: {"$ref": "#/$defs/i"} for p in integers(n)},
                                         "required": integers(n)}, None),
    # open alternatives: two enums side by side, and optional properties (+1: the object may close)
    ("alternatives (anyOf of enums)", LIMITS.max_alternatives, lambda n: {
        "anyOf": [{"enum": list(range(n // 2))}, {"enum": list(range(n - n // 2))}]}, ""),
    ("alternatives (optional properties)", LIMITS.max_alternatives, lambda n: {
        "type": "object", "properties": {p: {"type": "integer"} for p in integers(n - 1)}}, ""),
    ("depth", LIMITS.max_depth, lambda n: nested(n), ""),
]


def nested(depth: int) -> dict:
    """A schema whose JSON text nests exactly ``depth`` levels."""
    schema: dict = {"type": "integer"}
    level = 1
    while level + 2 <= depth:
        schema, level = {"anyOf": [schema]}, level + 2
    return schema if level == depth else {"type": "array", "items": schema}


@pytest.mark.parametrize("keyword, limit, make, path", VALUES + COUNTS, ids=[c[0] for c in VALUES + COUNTS])
def test_each_bound_holds_just_under_at_and_just_over_its_limit(keyword, limit, make, path):
    ok(make(limit - 1))
    ok(make(limit))
    err = refusal(make(limit + 1))
    assert str(limit) in err.message and str(limit + 1) in err.message, err.message
    if path is not None:
        assert err.param == P + path
    assert err.message.startswith(err.param)


@pytest.mark.parametrize("keyword, limit, make, path", VALUES, ids=[c[0] for c in VALUES])
def test_far_over_is_refused_as_cheaply(keyword, limit, make, path):
    err = refusal(make(10_000_000))
    assert err.param == P + path and "10000000" in err.message
    # as cheap as one just over: the check compares the number, it never counts up to it
    assert calls_made(refusal, make(10_000_000)) <= 2 * calls_made(refusal, make(limit + 1)) + 50


def test_the_issue_crasher_names_the_field_and_the_limit():
    err = refusal('{"type":"string","maxLength":100000}')
    assert err.param == P + ".maxLength"
    assert err.message == f"{P}.maxLength is 100000; at most {LIMITS.max_length} is allowed."


def test_size_just_under_at_and_just_over():
    def padded(size: int) -> str:
        bare = '{"type": "string", "description": ""}'
        return bare[:-2] + "x" * (size - len(bare)) + '"}'
    ok(padded(LIMITS.max_bytes - 1))
    ok(padded(LIMITS.max_bytes))
    err = refusal(padded(LIMITS.max_bytes + 1))
    assert err.param == P and f"{LIMITS.max_bytes + 1} bytes" in err.message
    assert rule(common_pb2.ResponseFormat, "json_schema").string.max_bytes == LIMITS.max_bytes
    assert rule(gateway_pb2.Tool, "parameters").string.max_bytes == LIMITS.max_bytes


def test_a_100000_deep_schema_is_refused_without_recursing():
    deep = '{"a":' * 100_000 + "1" + "}" * 100_000
    assert refusal(deep).param == P  # over the size first
    err = refusal(deep, SchemaLimits(max_bytes=10**7))
    assert "nested 100000 levels" in err.message
    assert text_depth('{"a": "[[[{{{", "b": [[1]], "c": "\\"["}') == 3


def test_the_walk_is_iterative_deeper_than_python_recurses():
    # 900 levels parse (json.loads stops near 1,000) and walk without recursion; the converter
    # would recurse ~3 frames a level, which is why max_depth is 64
    limits = SchemaLimits(max_depth=2000, max_grammar_bytes=10**9, max_alternatives=10**6)
    ok(nested(899), limits)
    assert text_depth("[" * 100_000 + "]" * 100_000) == 100_000


@pytest.mark.parametrize("value", [-1, 1.5, "10", True, None, [3]])
def test_counts_must_be_non_negative_integers(value):
    err = refusal({"type": "string", "maxLength": value})
    assert err.param == P + ".maxLength" and "non-negative integer" in err.message


def test_refs_must_be_local_and_resolve():
    assert "local reference" in refusal({"properties": {"a": {"$ref": "https://x.test/s"}}}).message
    assert "local reference" in refusal({"properties": {"a": {"$ref": "#"}}}).message
    err = refusal({"properties": {"a": {"$ref": "#/$defs/none"}}})
    assert err.param == P + ".properties.a.$ref" and "does not resolve" in err.message


def recursive(node: dict, name: str = "n") -> dict:
    return dict(node, **{"$defs": {name: node}})


def test_recursion_through_two_alternatives_is_refused():
    """anyOf [[a], [a]] inside a: the sampler's open alternatives double at each level
    (measured: 14 s a token at depth 12 for a 524-byte schema)."""
    arr = {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 1}
    node = {"type": "object", "properties": {"x": {"anyOf": [arr, dict(arr, title="b")]}}}
    err = refusal(recursive(node))
    assert err.param == P + ".$defs.n.properties.x.anyOf" and "lead back" in err.message
    both = {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "additionalProperties": {"$ref": "#/$defs/n"}}
    assert refusal(recursive(both)).param == P + ".$defs.n.additionalProperties"
    copy = {"type": "object", "properties": {"p": {"allOf": [{"$ref": "#/$defs/n"}]}}}
    assert refusal(recursive(copy)).param == P + ".$defs.n.properties.p.allOf"


def test_recursion_through_one_branch_at_a_time_is_allowed():
    ok(recursive({"type": "object", "properties": {"l": {"$ref": "#/$defs/n"}, "r": {"$ref": "#/$defs/n"}}}))
    tree = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#/$defs/t"}}]}
    ok({"type": "object", "properties": {"t": {"$ref": "#/$defs/t"}}, "$defs": {"t": tree}})


def test_alternatives_add_up_through_nesting_and_refs():
    enum = {"enum": list(range(64))}
    ok({"anyOf": [enum, {"$ref": "#/$defs/e"}], "$defs": {"e": enum}})
    err = refusal({"anyOf": [enum, {"$ref": "#/$defs/e"}, {"anyOf": [{"const": 1}]}], "$defs": {"e": enum}})
    assert err.param == P and f"{LIMITS.max_alternatives + 1} alternatives" in err.message


def test_the_grammar_estimate_just_under_at_and_just_over_its_limit():
    schema = json.dumps({"type": "object", "properties": {f"s{i}": {"type": "string", "maxLength": 500}
                                                          for i in range(20)}, "required": integers(20)})
    estimate = grammar_estimate(schema)
    for budget in (estimate + 1, estimate):
        ok(schema, SchemaLimits(max_grammar_bytes=budget))
    err = refusal(schema, SchemaLimits(max_grammar_bytes=estimate - 1))
    assert f"about {estimate} bytes" in err.message and f"at most {estimate - 1}" in err.message


def test_long_names_times_repetitions_are_refused_before_any_conversion():
    """Rule names grow with property names, and repetition copies them: 100 arrays of 256 items
    under one 8,000-character name would be a 200 MB grammar."""
    arrays = {f"a{i}": {"type": "array", "items": {"type": "integer"}, "maxItems": 256} for i in range(100)}
    err = refusal({"type": "object", "properties": {"k" * 8000: {"type": "object", "properties": arrays}}})
    assert "would expand to a grammar" in err.message


def test_the_estimate_is_never_below_what_the_converter_writes():
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from bench.hostile_schemas import cases

    checked = 0
    for _, name, body in cases(2 * LIMITS.max_bytes, "m"):
        if "tools" in body:
            continue
        text = json.dumps(body["response_format"]["json_schema"]["schema"])
        try:
            estimate = grammar_estimate(text)
            grammar = json_schema_to_gbnf(text)
        except Exception:  # noqa: BLE001 - refused by the bounds, or a schema the converter cannot express
            continue
        assert len(grammar) <= estimate, name
        checked += 1
    assert checked > 40


def test_the_schemas_of_a_request_together():
    check_request_size([("a", LIMITS.max_request_bytes - 1)])
    check_request_size([("a", LIMITS.max_request_bytes // 2), ("b", LIMITS.max_request_bytes // 2)])
    with pytest.raises(InvalidArgument) as info:
        check_request_size([("a", LIMITS.max_request_bytes // 2), ("b", LIMITS.max_request_bytes // 2 + 1)])
    assert info.value.param == "b"


def test_requests_name_the_field_in_response_format_and_tools():
    prompt = Prompt(messages=(Message("user", "x"),))
    crasher = '{"type":"object","properties":{"x":{"type":"string","maxLength":100000}}}'
    with pytest.raises(InvalidArgument) as info:
        check_request("m", prompt, Sampling(response_format=ResponseFormat("json_schema", crasher)))
    assert info.value.param == P + ".properties.x.maxLength"
    tools = Tools(functions=(Tool("f", "", '{"type":"object"}'), Tool("g", "", crasher)))
    with pytest.raises(InvalidArgument) as info:
        check_request("m", prompt, Sampling(), tools=tools, tools_allowed=True)
    assert info.value.param == "tools[1].function.parameters.properties.x.maxLength"
    many = Tools(functions=tuple(Tool(f"f{i}", "", json.dumps({"description": "d" * 60_000})) for i in range(5)))
    with pytest.raises(InvalidArgument) as info:
        check_request("m", prompt, Sampling(), tools=many, tools_allowed=True)
    assert "together" in info.value.message


def test_a_worst_case_schema_checks_in_linear_work():
    """Linear in the size: every hostile shape up to 64 KB (bench.hostile_schemas) costs at most a
    few calls per byte of schema (about 7.5 on the worst today; a quadratic walk of a 64 KB schema
    would make millions). bench.hostile times them."""
    from bench.hostile_schemas import cases

    worst = 0.0
    for _, _, body in cases(LIMITS.max_bytes + 1, "m"):
        if "tools" in body:
            continue
        text = json.dumps(body["response_format"]["json_schema"]["schema"])
        worst = max(worst, (calls_made(check_schema, text, P) - 200) / len(text))
    assert worst < 16, worst


def test_the_docs_list_the_table():
    rows = dict(re.findall(r"^\| `(\w+)` \| (\d+) \|", DOCS.read_text(), re.MULTILINE))
    assert {name: int(value) for name, value in rows.items()} == dict(LIMITS.table())

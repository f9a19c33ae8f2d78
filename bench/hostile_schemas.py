"""Adversarial JSON Schemas, per bounded keyword, as chat completion request bodies: each
bound of ``llmesh.schema_bounds`` just under, at and just over its limit and far over it (a
repetition bound also in a property, in items and behind a ``$ref``),
deep nesting, wide objects, huge enums, patterns with large quantifiers, ``$ref`` loops
and fan-outs, and schemas up to a size, in ``response_format`` and in a tool's
``parameters``. ``bench.hostile`` sends them; this module only builds them.

    python -m bench.hostile_schemas [--max-bytes N]

checks every case in process instead (the bounds, then, for a schema they accept, the
llama.cpp grammar: converted, its size and the bounds' estimate, parsed) and prints one
JSON document: per class, the cases accepted and refused and the worst times."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from llmesh.schema_bounds import LIMITS

Schema = dict[str, Any]
HUGE = 10_000_000
MAX_ENCODED_DEPTH = 240  # a schema's own nesting that the body's encoders (json, orjson) still take


def body(model: str, schema: Any, where: str = "response_format") -> dict[str, Any]:
    """A chat request carrying ``schema`` in its response_format or as its one tool's parameters."""
    out: dict[str, Any] = {"model": model, "max_tokens": 8,
                           "messages": [{"role": "user", "content": "Answer in JSON."}]}
    if where == "tools":
        out["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    else:
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return out


# Where a bounded keyword may sit besides the root: in an object's property, in an array's items,
# behind a $ref to a definition. The keyword's value is the same, so "at" stays at the limit.
PLACES: dict[str, Callable[[Schema], Schema]] = {
    "in a property": lambda s: {"type": "object", "properties": {"p": s}, "required": ["p"]},
    "in items": lambda s: {"type": "array", "items": s},
    "behind $ref": lambda s: {"type": "object", "properties": {"p": {"$ref": "#/$defs/s"}}, "$defs": {"s": s}},
}


def _around(limit: int) -> list[tuple[str, int]]:
    return [("under", limit - 1), ("at", limit), ("over", limit + 1), ("far over", HUGE)]


def _keyword_cases() -> Iterator[tuple[str, str, Schema]]:
    lim = LIMITS
    shapes: list[tuple[str, int, Callable[[int], Schema]]] = [
        ("minLength", lim.max_length, lambda n: {"type": "string", "minLength": n}),
        ("maxLength", lim.max_length, lambda n: {"type": "string", "maxLength": n}),
        ("minItems", lim.max_items, lambda n: {"type": "array", "items": {"type": "integer"}, "minItems": n}),
        ("maxItems", lim.max_items, lambda n: {"type": "array", "items": {"type": "integer"}, "maxItems": n}),
        ("minProperties", lim.max_object_size, lambda n: {"type": "object", "minProperties": n}),
        ("maxProperties", lim.max_object_size, lambda n: {"type": "object", "maxProperties": n}),
        ("pattern repeat", lim.max_pattern_repeat, lambda n: {"type": "string", "pattern": f"^[a-z]{{0,{n}}}$"}),
        ("pattern repeat exact", lim.max_pattern_repeat, lambda n: {"type": "string", "pattern": f"^(ab){{{n}}}$"}),
    ]
    for keyword, limit, make in shapes:
        for label, n in _around(limit):
            yield f"schema.{keyword}", f"{keyword}={n} ({label})", make(n)
            for where, place in PLACES.items():  # a bound is checked wherever the schema puts it
                yield f"schema.{keyword}", f"{keyword}={n} ({label}, {where})", place(make(n))
    counted: list[tuple[str, int, Callable[[int], Schema]]] = [
        ("enum", lim.max_enum, lambda n: {"enum": [f"v{i}" for i in range(n)]}),
        ("properties", lim.max_properties, lambda n: {
            "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
            "required": [f"p{i}" for i in range(n)]}),
        ("anyOf", lim.max_branches, lambda n: {"anyOf": [{"type": "integer", "minimum": i} for i in range(n)]}),
        ("oneOf", lim.max_branches, lambda n: {"oneOf": [{"const": i} for i in range(n)]}),
        ("allOf", lim.max_branches, lambda n: {"allOf": [{"properties": {f"p{i}": {"type": "integer"}}}
                                                         for i in range(n)]}),
        ("prefixItems", lim.max_branches, lambda n: {"type": "array", "prefixItems": [{"type": "integer"}] * n}),
        ("type list", lim.max_branches, lambda n: {"type": ["string", "null"] * (n // 2) + ["integer"] * (n % 2)}),
        ("pattern groups", lim.max_pattern_groups, lambda n: {"type": "string", "pattern": "^" + "(" * n + "a"
                                                                  + ")" * n + "$"}),
        ("alternatives", lim.max_alternatives, lambda n: {"anyOf": [{"enum": list(range(n // 2))},
                                                                    {"enum": list(range(n - n // 2))}]}),
        ("optional properties", lim.max_alternatives, lambda n: {
            "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n - 1)}}),
        ("$ref count", lim.max_refs, lambda n: {
            "$defs": {"i": {"type": "integer"}}, "type": "object", "required": [f"p{i}" for i in range(n)],
            "properties": {f"p{i}": {"$ref": "#/$defs/i"} for i in range(n)}}),
        ("depth", lim.max_depth, _nested_arrays),
    ]
    for keyword, limit, make in counted:
        # far over, but within what JSON encoders nest (orjson: 255 levels, with the body's own)
        far = min(limit * 16, MAX_ENCODED_DEPTH) if keyword == "depth" else limit * 16
        for label, n in _around(limit)[:3] + [("far over", far)]:
            yield f"schema.{keyword}", f"{keyword} {n} ({label})", make(n)


def _nested_arrays(depth: int) -> Schema:
    """A schema whose JSON text nests exactly ``depth`` levels (anyOf inside anyOf)."""
    schema: Schema = {"type": "integer"}
    level = 1
    while level + 2 <= depth:
        schema, level = {"anyOf": [schema]}, level + 2
    if level < depth:
        schema = {"type": "array", "items": schema}
    return schema


def _odd_values() -> Iterator[tuple[str, str, Schema]]:
    for keyword in ("minLength", "maxItems", "maxProperties"):
        for value in (-1, 1.5, "10", True, None, [3], 10**40):
            yield "schema.type", f"{keyword}={json.dumps(value)}", {keyword: value, "type": "string"}
    yield "schema.type", "enum not a list", {"enum": {"a": 1}}
    yield "schema.type", "pattern not a string", {"type": "string", "pattern": 5}
    yield "schema.range", "huge integer range", {"type": "integer", "minimum": -(10**300), "maximum": 10**300}
    yield "schema.range", "float range", {"type": "number", "minimum": -1e308, "maximum": 1e308,
                                          "exclusiveMinimum": -1e308}


def _recursion_cases() -> Iterator[tuple[str, str, Schema]]:
    arr: Schema = {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1, "maxItems": 1}
    a: Schema = {"type": "object", "required": ["x"],
                 "properties": {"x": {"anyOf": [arr, dict(arr, description="b")]}}}
    yield "schema.$ref", "anyOf of two recursive branches (exponential)", dict(a, **{"$defs": {"a": a}})
    n: Schema = {"type": "object", "properties": {"l": {"$ref": "#/$defs/n"}, "r": {"$ref": "#/$defs/n"}}}
    yield "schema.$ref", "binary tree (allowed)", dict(n, **{"$defs": {"n": n}})
    tree: Schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#/$defs/t"}}]}
    yield "schema.$ref", "JSON tree (allowed)", {"type": "object", "properties": {"t": {"$ref": "#/$defs/t"}},
                                                  "$defs": {"t": tree}}
    e: Schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/e"}},
                 "additionalProperties": {"$ref": "#/$defs/e"}}
    yield "schema.$ref", "property and additionalProperties recursive", dict(e, **{"$defs": {"e": e}})
    s: Schema = {"type": "object", "properties": {"p": {"allOf": [{"$ref": "#/$defs/s"}]}}}
    yield "schema.$ref", "allOf recursive", dict(s, **{"$defs": {"s": s}})
    left = {"anyOf": [{"$ref": "#/$defs/l"}, {"type": "null"}]}
    yield "schema.$ref", "left recursion", {"type": "object", "properties": {"v": {"$ref": "#/$defs/l"}},
                                            "$defs": {"l": left}}
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(100)}
    defs["d100"] = {"type": "integer"}
    yield "schema.$ref", "chain of 100 refs", {"type": "object", "properties": {"v": {"$ref": "#/$defs/d0"}},
                                               "$defs": defs}
    loop = {"d0": {"$ref": "#/$defs/d1"}, "d1": {"$ref": "#/$defs/d0"}}
    yield "schema.$ref", "ref loop", {"type": "object", "properties": {"v": {"$ref": "#/$defs/d0"}}, "$defs": loop}
    yield "schema.$ref", "remote ref", {"type": "object", "properties": {"v": {"$ref": "https://x.test/s"}}}
    yield "schema.$ref", "missing ref", {"type": "object", "properties": {"v": {"$ref": "#/$defs/none"}}}
    yield "schema.$ref", "root ref", {"type": "object", "properties": {"v": {"$ref": "#"}}}
    fan = {"type": "object", "properties": {f"p{i}": {"type": "array", "items": {"type": "integer"},
                                                      "maxItems": 200} for i in range(20)}}
    yield "schema.$ref", "allOf copies of one wide definition", {
        "type": "object", "$defs": {"w": fan},
        "properties": {f"q{i}": {"allOf": [{"$ref": "#/$defs/w"}]} for i in range(60)}}


def _sized_cases(max_bytes: int) -> Iterator[tuple[str, str, Schema]]:
    """Schemas of a given size: the size limit, and up to ``max_bytes``."""
    limit = LIMITS.max_bytes
    sizes = sorted({limit - 1, limit, limit + 1, max_bytes // 2, max_bytes - 4096})
    for size in (s for s in sizes if 0 < s):
        yield "schema.bytes", f"{size} bytes of description", _padded({"type": "string"}, size)
        yield "schema.bytes", f"{size} bytes of enum", _enum_of_size(size)
        yield "schema.wide", f"{size} bytes of properties", _wide(size)
        yield "schema.depth", f"{size} bytes, nested {MAX_ENCODED_DEPTH} levels", _deep(size)
    name = "k" * 8000
    yield "schema.grammar", "long names times repetitions", {
        "type": "object", "properties": {name: {"type": "object", "properties": {
            f"a{i}": {"type": "array", "items": {"type": "integer"}, "maxItems": 256} for i in range(100)}}}}
    yield "schema.grammar", "many max strings", {"type": "object", "required": [f"s{i}" for i in range(128)],
                                                 "properties": {f"s{i}": {"type": "string", "maxLength": 512}
                                                                for i in range(128)}}


def _padded(schema: Schema, size: int) -> Schema:
    bare = len(json.dumps(dict(schema, description="")))
    return dict(schema, description="x" * max(0, size - bare))


def _enum_of_size(size: int) -> Schema:
    count = max(1, min(LIMITS.max_enum, size // 64))
    width = max(1, size // count - 4)
    return {"enum": [f"{i:06d}" + "e" * (width - 6) for i in range(count)]}


def _wide(size: int) -> Schema:
    """As many properties as allowed, each padded alike, to about ``size`` bytes."""
    n = LIMITS.max_properties
    names = [f"p{i:03d}" for i in range(n)]
    bare = len(json.dumps({"type": "object", "properties": {name: {"type": "string", "description": ""}
                                                            for name in names}, "required": names}))
    pad = "w" * max(0, (size - bare) // n)
    return {"type": "object", "properties": {name: {"type": "string", "description": pad} for name in names},
            "required": names}


def _deep(size: int) -> Schema:
    """A ``default`` value nested as deep as JSON encoders take (or ``size`` allows), padded to ``size``."""
    levels = max(1, min(MAX_ENCODED_DEPTH, (size - 40) // 2))
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return _padded({"type": "object", "default": value}, size)


def cases(max_bytes: int, model: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(class, case name, body of POST /v1/chat/completions), each schema in response_format
    and again as a tool's parameters."""
    groups: list[Iterator[tuple[str, str, Any]]] = [_keyword_cases(), _odd_values(), _recursion_cases(),
                                                    _sized_cases(max_bytes)]
    for group in groups:
        for cls, name, schema in group:
            yield cls, name, body(model, schema, "response_format")
            yield cls, f"{name} [tool]", body(model, schema, "tools")


def _check_in_process(max_bytes: int, vocab_path: str | None) -> dict[str, Any]:
    """Every response_format case through the bounds; those accepted through the converter
    (size against the bounds' estimate) and, given a GGUF, llama.cpp's parser and one
    grammar step over the whole vocabulary (what decoding pays per token)."""
    from llmesh.engine.backends.llamacpp_grammar import schema_grammar
    from llmesh.errors import InvalidArgument
    from llmesh.schema_bounds import grammar_estimate

    parse = _parser(vocab_path) if vocab_path else None
    classes: dict[str, dict[str, Any]] = {}
    for cls, name, request in cases(max_bytes, "bench"):
        if "tools" in request:
            continue
        text = json.dumps(request["response_format"]["json_schema"]["schema"])
        row = classes.setdefault(cls, {"cases": 0, "accepted": 0, "refused": 0, "worst_check_ms": 0.0,
                                       "worst_convert_ms": 0.0, "worst_grammar_bytes": 0, "worst_parse_ms": 0.0,
                                       "worst_step_ms": 0.0, "estimate_low": []})
        row["cases"] += 1
        started = time.perf_counter()
        try:
            estimate = grammar_estimate(text)
        except InvalidArgument:
            row["refused"] += 1
            continue
        finally:
            row["worst_check_ms"] = max(row["worst_check_ms"], (time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        try:
            grammar = schema_grammar(text)
        except InvalidArgument as exc:
            row["refused"] += 1
            print(f"{cls} {name}: converter refused: {exc.message[:120]}", file=sys.stderr)
            continue
        row["accepted"] += 1
        row["worst_convert_ms"] = max(row["worst_convert_ms"], (time.perf_counter() - started) * 1000)
        row["worst_grammar_bytes"] = max(row["worst_grammar_bytes"], len(grammar))
        if len(grammar) > estimate:
            row["estimate_low"].append(f"{name}: {len(grammar)} > {estimate}")
        if parse is not None:
            parse_ms, step_ms = parse(grammar)
            row["worst_parse_ms"] = max(row["worst_parse_ms"], parse_ms)
            row["worst_step_ms"] = max(row["worst_step_ms"], step_ms)
    return {"max_bytes": max_bytes, "limits": dict(LIMITS.table()), "classes": classes}


def _parser(vocab_path: str) -> Callable[[str], tuple[float, float]]:
    import ctypes

    import llama_cpp as lc

    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(vocab_path.encode(), params)
    vocab = lc.llama_model_get_vocab(model)
    n = lc.llama_vocab_n_tokens(vocab)

    def parse(grammar: str) -> tuple[float, float]:
        started = time.perf_counter()
        sampler = lc.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        parse_ms = (time.perf_counter() - started) * 1000
        if not sampler:
            return parse_ms, 0.0
        data = (lc.llama_token_data * n)(*(lc.llama_token_data(i, 0.0, 0.0) for i in range(n)))
        started = time.perf_counter()
        lc.llama_sampler_apply(sampler, ctypes.byref(lc.llama_token_data_array(data, n, -1, False)))
        step_ms = (time.perf_counter() - started) * 1000
        lc.llama_sampler_free(sampler)
        return parse_ms, step_ms
    return parse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-bytes", type=int, default=16 * 2**20, help="the largest schema (the body limit)")
    ap.add_argument("--gguf", help="a GGUF whose vocabulary llama.cpp parses the grammars with")
    args = ap.parse_args()
    print(json.dumps(_check_in_process(args.max_bytes, args.gguf), indent=1))


if __name__ == "__main__":
    main()

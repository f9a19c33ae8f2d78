"""Bounds on the JSON Schemas a request carries (``response_format``'s schema and each
tool's ``parameters``), checked before any converter sees them: by the gateway for both
fronts, and by the engine again (gRPC clients may call it directly).

Why: a converter turns a schema into a grammar, and grammar tools expand what a schema
only states. llama-cpp-python's converter (0.3.36) writes ``maxLength: n`` as n nested
optional groups and ``minItems: n`` as n copies of the item rule; llama.cpp's grammar
parser recurses once per nested group (it crashed the engine with SIGSEGV from 19,000
levels) and refuses over 1,000 nested ``?`` groups; the sampler checks every vocabulary
token against every open alternative at every step (~0.3-0.55 ms per open alternative
and token here, on top of ~10 ms); and an ``anyOf`` with two branches that recurse into
the same schema doubles the open alternatives at each level of the answer (a 524-byte
schema took 14 s a token at depth 12). So the limits below cap each of those: the
table's comments give what was measured and the margin kept.

The walk is iterative and linear in the schema's size: the text's nesting is measured
before ``json.loads``, then every schema object is visited once, then the grammar the
schema would expand to is summed over a graph of the schemas (their nesting, ``$ref``
and ``allOf`` edges), in one pass of Tarjan's algorithm, without recursion."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from itertools import accumulate
from typing import Any

from llmesh.errors import InvalidArgument
from llmesh.schema_graph import Graph, Node, analyse


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """What one schema may hold. Measured on this machine (2 cores, llama-cpp-python
    0.3.36, SmolLM2's 49,152-token vocabulary); see docs/api.md#schema-limits."""

    # The schema's JSON text, in UTF-8 bytes (the protos' max_bytes rule says the same).
    max_bytes: int = 65_536
    # Nesting of the JSON text (each object or array is a level; a property's schema is two
    # levels below its object). The converter recurses ~3 Python frames a schema level.
    max_depth: int = 64
    # Keys of one ``properties`` object. Each is a rule; optional ones are also open
    # alternatives (max_alternatives), and their rules cost the converter O(n^2):
    # 128 optional properties took 50 ms to convert, 512 took 1.3 s.
    max_properties: int = 128
    # Values of one ``enum``: each one an open alternative (100 values: 36 ms a token,
    # 1,000: 280 ms, 16,000: 6.5 s and 1.3 s to parse).
    max_enum: int = 128
    # Entries of one ``anyOf`` / ``oneOf`` / ``allOf`` / ``prefixItems`` / ``type`` list.
    max_branches: int = 64
    # Alternatives open at one point of an answer: enum values, anyOf/oneOf branches,
    # type lists, optional properties, pattern alternatives, summed through nesting and
    # $ref. Each costs the sampler ~0.3-0.55 ms a token over a ~10-15 ms floor: 128 measured
    # 35-65 ms a token (an anyOf of 500 objects: 275 ms; of 4,000: 2.4 s).
    max_alternatives: int = 128
    # minItems / maxItems: n copies of the item rule, and max - min nested groups
    # (llama.cpp refuses over 1,000 nested groups and crashed from 19,000; minItems
    # 10,000,000 was a 180 MB grammar, 1 s and 530 MB to convert).
    max_items: int = 256
    # minLength / maxLength: n characters, max - min nested groups (the 36-byte crasher was
    # maxLength 100,000; 1,000 was the most llama.cpp parsed).
    max_length: int = 512
    # minProperties / maxProperties (not expanded by today's converter; newer ones may).
    max_object_size: int = 128
    # A ``{n}``, ``{n,}`` or ``{n,m}`` count inside a ``pattern``: expanded like maxLength
    # (a group's copies name a sub-rule, so counts add up rather than multiply).
    max_pattern_repeat: int = 256
    # Nested groups ``( )`` in a ``pattern``: each is a nested group of the grammar.
    max_pattern_groups: int = 32
    # ``$ref`` occurrences. Refs must be local (``#/...``) and resolve; a recursive schema
    # may recurse through at most one branch of an anyOf / oneOf, not through allOf (the
    # converter copies it without end), and not through a property and additionalProperties.
    max_refs: int = 128
    # The grammar the schema expands to, estimated before conversion (never below the real
    # one over the bench's cases and 1,200 random schemas; the engine checks the real one).
    # llama.cpp parses 0.5 MB in ~11 ms, 5 MB in 69 ms, on the thread that decodes every
    # request; rule names grow with property names and repetition copies them (100 arrays
    # of 256 under one 8,000-character name: 200 MB).
    max_grammar_bytes: int = 524_288
    # The schemas of one request together (response_format and every tool's parameters):
    # the walk runs on the gateway's event loop.
    max_request_bytes: int = 262_144

    def table(self) -> list[tuple[str, int]]:
        """(name, limit) for each bound, in the order above (docs and tests read it)."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


LIMITS = SchemaLimits()

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r'[^\[\]{}]+')
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_PLAIN_KEY = re.compile(r"[A-Za-z_$][A-Za-z0-9_$-]{0,63}")
_REPEAT_KEYS = (("minItems", "max_items"), ("maxItems", "max_items"), ("minLength", "max_length"),
                ("maxLength", "max_length"), ("minProperties", "max_object_size"),
                ("maxProperties", "max_object_size"))
# Keywords whose value is a schema, a list of schemas, or an object of schemas.
_ONE = ("additionalProperties", "items", "contains", "additionalItems", "not", "if", "then", "else",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def text_depth(text: str) -> int:
    """How deep the JSON text nests (objects and arrays), without parsing it."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def path_part(key: str | int) -> str:
    """A key or index as a field path writes it: ``.name``, ``["odd key"]``, ``[3]``."""
    if isinstance(key, int):
        return f"[{key}]"
    if _PLAIN_KEY.fullmatch(key):
        return "." + key
    return "[" + json.dumps(key[:40] + ("..." if len(key) > 40 else "")) + "]"


def check_schema(text: str, param: str, limits: SchemaLimits = LIMITS) -> dict[str, Any]:
    """The schema parsed, once it is within ``limits``; InvalidArgument naming the
    field (``param`` and the path inside the schema) and the limit otherwise."""
    return _checked(text, param, limits)[0]


def grammar_estimate(text: str, limits: SchemaLimits = LIMITS) -> int:
    """The grammar bytes a schema within ``limits`` is expected to expand to at most."""
    return _checked(text, "schema", limits)[1]


def _checked(text: str, param: str, limits: SchemaLimits) -> tuple[dict[str, Any], int]:
    size = len(text) if len(text) > limits.max_bytes else len(text.encode())  # no copy of what is over anyway
    if size > limits.max_bytes:
        raise InvalidArgument(f"{param} is {size} bytes; at most {limits.max_bytes} are allowed.", param=param)
    depth = text_depth(text)
    if depth > limits.max_depth:
        raise InvalidArgument(f"{param} is nested {depth} levels deep; at most {limits.max_depth} are allowed.",
                              param=param)
    try:
        schema = json.loads(text)
    except ValueError:
        raise InvalidArgument(f"{param} is not valid JSON.", param=param) from None
    if not isinstance(schema, dict):
        raise InvalidArgument(f"{param} must be a JSON object.", param=param)
    graph = _Walk(schema, param, limits).run()
    return schema, analyse(graph, limits.max_alternatives, limits.max_grammar_bytes, size)


def check_request_size(sizes: list[tuple[str, int]], limits: SchemaLimits = LIMITS) -> None:
    """The schemas of one request together, before any is walked: (param, characters)
    each (a character is at least a byte: over in characters is over in bytes)."""
    total = sum(n for _, n in sizes)
    if total > limits.max_request_bytes:
        param = max(sizes, key=lambda s: s[1])[0]
        raise InvalidArgument(f"The request's JSON schemas are {total} characters together; at most "
                              f"{limits.max_request_bytes} bytes are allowed.", param=param)


class _Walk:
    """Visits every schema object once (an explicit stack), checks each keyword's bound
    and records the graph ``analyse`` sums over."""

    def __init__(self, root: dict[str, Any], param: str, limits: SchemaLimits):
        self.root = root
        self.limits = limits
        self.graph = Graph(param)
        self.refs: list[tuple[int, str]] = []  # (node, $ref) to resolve once the tree is known
        self.stack: list[int] = []

    def node(self, schema: dict[str, Any], parent: int, part: str) -> int:
        index = self.graph.index.get(id(schema))
        if index is None:
            index = self.graph.add(Node(schema, parent, part))
            self.stack.append(index)
        return index

    def run(self) -> Graph:
        self.node(self.root, -1, "")
        while True:
            while self.stack:
                self.visit(self.stack.pop())
            if not self.refs:
                break
            self.resolve(*self.refs.pop())
        for node in self.graph.nodes:
            _grammar_edges(self.graph, node)
        return self.graph

    def fail(self, at: int, suffix: str, message: str) -> InvalidArgument:
        return self.graph.fail(at, suffix, message)

    def visit(self, at: int) -> None:
        schema = self.graph.nodes[at].schema
        self.bounds(at, schema)
        for key in _ONE:
            if isinstance(child := schema.get(key), dict):
                self.node(child, at, path_part(key))
        for key in _LIST:
            if isinstance(children := schema.get(key), list):
                if len(children) > self.limits.max_branches:
                    raise self.fail(at, path_part(key), f"has {len(children)} entries; at most "
                                    f"{self.limits.max_branches} are allowed.")
                for i, child in enumerate(children):
                    if isinstance(child, dict):
                        self.node(child, at, path_part(key) + f"[{i}]")
        for key in _MAP:
            if isinstance(children := schema.get(key), dict):
                if key == "properties" and len(children) > self.limits.max_properties:
                    raise self.fail(at, ".properties", f"has {len(children)} properties; at most "
                                    f"{self.limits.max_properties} are allowed.")
                for name, child in children.items():
                    if isinstance(child, dict):
                        self.node(child, at, path_part(key) + path_part(name))
        if "$ref" in schema:
            self.ref(at, schema["$ref"])

    def bounds(self, at: int, schema: dict[str, Any]) -> None:
        lim = self.limits
        for key, limit_name in _REPEAT_KEYS:
            if key in schema:
                value, limit = schema[key], getattr(lim, limit_name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise self.fail(at, "." + key, "must be a non-negative integer.")
                if value > limit:
                    raise self.fail(at, "." + key, f"is {value}; at most {limit} is allowed.")
        enum = schema.get("enum")
        if enum is not None:
            if not isinstance(enum, list):
                raise self.fail(at, ".enum", "must be an array.")
            if len(enum) > lim.max_enum:
                raise self.fail(at, ".enum", f"has {len(enum)} values; at most {lim.max_enum} are allowed.")
        kinds = schema.get("type")
        if isinstance(kinds, list) and len(kinds) > lim.max_branches:
            raise self.fail(at, ".type", f"has {len(kinds)} entries; at most {lim.max_branches} are allowed.")
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            self.graph.nodes[at].pattern = self.pattern(at, pattern)

    def pattern(self, at: int, pattern: str) -> tuple[int, int]:
        """(alternatives, repetitions) of a regular expression, its counts and nesting checked."""
        lim = self.limits
        stats = pattern_stats(pattern)
        if stats.groups > lim.max_pattern_groups:
            raise self.fail(at, ".pattern", f"nests {stats.groups} groups; at most {lim.max_pattern_groups} "
                            "are allowed.")
        if stats.repeat > lim.max_pattern_repeat:
            raise self.fail(at, ".pattern", f"repeats {stats.repeat} times ({stats.quantifier}); at most "
                            f"{lim.max_pattern_repeat} is allowed.")
        return stats.alternatives, stats.total

    def ref(self, at: int, ref: Any) -> None:
        self.graph.ref_count += 1
        if self.graph.ref_count > self.limits.max_refs:
            raise self.fail(at, ".$ref", f"is the schema's $ref number {self.graph.ref_count}; at most "
                            f"{self.limits.max_refs} are allowed.")
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise self.fail(at, ".$ref", "must be a local reference (\"#/...\").")
        self.refs.append((at, ref))

    def resolve(self, at: int, ref: str) -> None:
        """The converter's own reading of a pointer: object keys, split on '/'."""
        target: Any = self.root
        for key in ref[2:].split("/"):
            if not isinstance(target, dict) or key not in target:
                raise self.fail(at, ".$ref", f"{json.dumps(ref[:80])} does not resolve to a schema.")
            target = target[key]
        if not isinstance(target, dict):
            raise self.fail(at, ".$ref", f"{json.dumps(ref[:80])} does not resolve to a schema.")
        node = self.graph.nodes[at]
        node.ref = self.node(target, -1, "".join(path_part(k) for k in ref[2:].split("/")))
        node.ref_name = len(ref.rsplit("/", 1)[-1])


@dataclass(slots=True)
class PatternStats:
    alternatives: int = 1  # branches of its alternations, nested ones included
    repeat: int = 0        # the largest count in a {n} / {n,} / {n,m} quantifier
    quantifier: str = ""   # that quantifier, as written
    total: int = 0         # all counts together (each is a copy of its item in the grammar)
    groups: int = 0        # the deepest nesting of ( )


def pattern_stats(pattern: str) -> PatternStats:
    """One pass over a regular expression as the converter reads it: escapes and
    ``[...]`` classes are single items, ``{...}`` after an item is a quantifier."""
    stats = PatternStats()
    depth, i, n = 0, 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif c == "(":
            depth += 1
            stats.groups = max(stats.groups, depth)
        elif c == ")":
            depth -= 1
        elif c == "|":
            stats.alternatives += 1
        elif c == "{":
            end = pattern.find("}", i)
            if end < 0:
                break
            count = _count(pattern[i + 1:end])
            stats.total += count
            if count > stats.repeat:
                stats.repeat, stats.quantifier = count, pattern[i:end + 1][:40]
            i = end
        i += 1
    return stats


def _count(inside: str) -> int:
    """The largest number in a quantifier's ``n`` / ``n,`` / ``n,m`` (0 if none)."""
    best = 0
    for part in inside.split(","):
        digits = part.strip()
        if digits.isdigit():
            best = max(best, int(digits) if len(digits) <= 9 else 10**9)
    return best


def _grammar_edges(graph: Graph, node: Node) -> None:
    """The schemas the converter visits from ``node``, as its ``visit`` dispatches: the
    first matching keyword wins (llama_cpp.llama_grammar.SchemaConverter.visit)."""
    s = node.schema
    kinds = s.get("type")
    if node.ref is not None:
        node.edge(node.ref, "ref", 0)
    elif branches := (s.get("oneOf") or s.get("anyOf")):
        for i, child in enumerate(branches if isinstance(branches, list) else ()):
            graph.edge_to(node, child, "alt", len(str(i)) + 1)
    elif isinstance(kinds, list):
        node.open = len(kinds)
    elif "const" in s:
        pass
    elif "enum" in s:
        node.open = len(s["enum"])
    elif kinds in (None, "object") and ("properties" in s or ("additionalProperties" in s
                                                              and s["additionalProperties"] is not True)):
        _object_edges(graph, node)
    elif kinds in (None, "object") and "allOf" in s:
        _all_of_edges(graph, node)
    elif kinds in (None, "array") and ("items" in s or "prefixItems" in s):
        _array_edges(graph, node)
    elif kinds in (None, "string") and node.pattern is not None:
        node.open, node.repeats = node.pattern
    elif kinds == "string":
        node.chars = max(_int(s.get("minLength")), _int(s.get("maxLength")))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _object_edges(graph: Graph, node: Node) -> None:
    s = node.schema
    props = s.get("properties")
    props = props if isinstance(props, dict) else {}
    required = s.get("required")
    required = set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) else set()
    optional = sum(1 for name in props if name not in required)
    for name, child in props.items():
        graph.edge_to(node, child, "seq", len(name) + 1)
    extra = s.get("additionalProperties")
    if isinstance(extra, dict):
        graph.edge_to(node, extra, "extra", 17)
    node.open = optional + (1 if extra not in (None, False) else 0) + 1


def _all_of_edges(graph: Graph, node: Node) -> None:
    """allOf merges its components' properties into one object, each visited again under
    this schema's name (a $ref component's too: the converter copies them)."""
    comps = node.schema.get("allOf")
    optional = 0
    for comp in comps if isinstance(comps, list) else ():
        some = isinstance(comp, dict) and "anyOf" in comp  # each of its members' properties is optional
        members = comp["anyOf"] if some else [comp]
        for member in members if isinstance(members, list) else ():
            member = graph.ref_target(member)
            props = member.get("properties") if isinstance(member, dict) else None
            for name, child in props.items() if isinstance(props, dict) else ():
                graph.edge_to(node, child, "inline", len(name) + 1)
                optional += some
    node.open = optional + 1


def _array_edges(graph: Graph, node: Node) -> None:
    s = node.schema
    items = s.get("items") or s.get("prefixItems")
    if isinstance(items, list):
        for i, child in enumerate(items):
            graph.edge_to(node, child, "seq", len(f"tuple-{i}") + 1)
    elif isinstance(items, dict):
        graph.edge_to(node, items, "seq", 5)
        node.repeats = max(_int(s.get("minItems")), _int(s.get("maxItems")))

"""The graph of a JSON Schema's subschemas as a grammar converter visits them, and what
it sums over that graph: the alternatives open at one point of an answer, the size of
the grammar the schema expands to, and the recursions a grammar sampler cannot afford.
Pure and iterative (no recursion, however the schema nests); ``schema_bounds`` builds
the graph and says why each bound is what it is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmesh.errors import InvalidArgument

# What a grammar costs beyond its rule names, in bytes: the converter's built-in rules
# (value, object, string, date...: 1,662 bytes in llama-cpp-python 0.3.36), a rule's own
# line, a name reference's spaces and punctuation, a repeated item's, a string character's.
BASE_BYTES, RULE_BYTES, NAME_BYTES, REPEAT_BYTES, CHAR_BYTES = 2048, 64, 16, 24, 8
# How often a parent's rules name a child: a property's -kv and -rest rules are defined and
# each named twice (the object's alternatives, the previous -rest); a branch once or twice.
MENTIONS = {"seq": 6, "extra": 6, "inline": 6, "alt": 2}
_BIG = 1 << 62  # sums stop growing here (a schema may re-expand another exponentially often)


@dataclass(slots=True, eq=False)
class Node:
    """One subschema. ``edges``: (node, kind, name suffix length), kind one of ``alt``
    (anyOf/oneOf branch), ``ref``, ``seq`` (property, item), ``extra``
    (additionalProperties) and ``inline`` (a property allOf copies in)."""
    schema: dict[str, Any]
    parent: int
    part: str
    edges: list[tuple[int, str, int]] = field(default_factory=list)
    ref: int | None = None
    ref_name: int = 0                    # length of the name a $ref target's rules get
    pattern: tuple[int, int] | None = None  # (alternatives, repetitions) of its pattern
    open: int = 1                        # alternatives it opens itself
    names: int = 1                       # rule names its own rules mention
    repeats: int = 0                     # copies of a child's rule name (minItems, pattern counts)
    chars: int = 0                       # string characters spelled out (min/maxLength)

    def edge(self, to: int, kind: str, suffix: int) -> None:
        self.edges.append((to, kind, suffix))


@dataclass(slots=True)
class Graph:
    param: str
    nodes: list[Node] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)  # id(schema object) -> node
    ref_count: int = 0

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        self.index[id(node.schema)] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def edge_to(self, node: Node, child: Any, kind: str, suffix: int) -> None:
        at = self.index.get(id(child)) if isinstance(child, dict) else None
        if at is not None:
            node.edge(at, kind, suffix)

    def ref_target(self, schema: Any) -> Any:
        """What a ``{"$ref": ...}`` schema stands for (the schema itself otherwise)."""
        at = self.index.get(id(schema)) if isinstance(schema, dict) else None
        ref = self.nodes[at].ref if at is not None else None
        return self.nodes[ref].schema if ref is not None else schema

    def path(self, at: int) -> str:
        parts = []
        while at >= 0:
            node = self.nodes[at]
            parts.append(node.part)
            at = node.parent
        return self.param + "".join(reversed(parts))

    def fail(self, at: int, suffix: str, message: str) -> InvalidArgument:
        param = self.path(at) + suffix
        return InvalidArgument(f"{param} {message}", param=param)


def components(nodes: list[Node]) -> list[list[int]]:
    """Tarjan's strongly connected components, iteratively, sinks first."""
    n = len(nodes)
    index, low, on = [-1] * n, [0] * n, [False] * n
    stack: list[int] = []
    out: list[list[int]] = []
    counter = 0
    for start in range(n):
        if index[start] != -1:
            continue
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on[start] = True
        work = [(start, 0)]
        while work:
            v, i = work[-1]
            edges = nodes[v].edges
            if i < len(edges):
                work[-1] = (v, i + 1)
                w = edges[i][0]
                if index[w] == -1:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on[w] = True
                    work.append((w, 0))
                elif on[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on[w] = False
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
    return out


def _check_recursion(graph: Graph, comp_of: list[int]) -> None:
    """A schema that recurses through two alternatives that can start alike (two anyOf
    branches, a property and additionalProperties) doubles the sampler's open
    alternatives at every level of the answer; through allOf, the converter copies it
    without end."""
    for at, node in enumerate(graph.nodes):
        mine = comp_of[at]
        looping = [(kind, to) for to, kind, _ in node.edges if comp_of[to] == mine]
        alts = sum(1 for kind, _ in looping if kind == "alt")
        if alts > 1:
            key = "oneOf" if node.schema.get("oneOf") else "anyOf"
            raise graph.fail(at, "." + key, f"has {alts} branches that lead back into a schema that "
                             "contains them ($ref); at most 1 may.")
        kinds = {kind for kind, _ in looping}
        if "extra" in kinds and "seq" in kinds:
            raise graph.fail(at, ".additionalProperties", "and a property both lead back into a schema that "
                             "contains them ($ref); only one of them may.")
        if "inline" in kinds:
            raise graph.fail(at, ".allOf", "leads back into a schema that contains it ($ref); allOf "
                             "cannot recurse.")


def analyse(graph: Graph, max_alternatives: int, max_grammar_bytes: int, text_bytes: int) -> int:
    """Refuses recursion a sampler cannot afford, more than ``max_alternatives`` open
    at one point, and a grammar estimated over ``max_grammar_bytes``; returns the estimate."""
    nodes = graph.nodes
    comps = components(nodes)
    comp_of = [0] * len(nodes)
    for c, comp in enumerate(comps):
        for at in comp:
            comp_of[at] = c
    _check_recursion(graph, comp_of)
    live = [0] * len(nodes)
    const = [0] * len(nodes)
    coeff = [0] * len(nodes)
    over = -1  # the first subschema (sinks first) whose own grammar is over budget
    for comp in comps:
        for at in comp:
            node = nodes[at]
            live[at] = _live(node, live)
            if live[at] > max_alternatives:
                raise graph.fail(at, "", f"can leave {live[at]} alternatives open at one point of the answer "
                                 "(enum values, anyOf/oneOf branches, types, optional properties and pattern "
                                 f"alternatives, through nesting and $ref); at most {max_alternatives} are allowed.")
            const[at], coeff[at] = _cost(node, const, coeff)
            if over < 0 and const[at] > max_grammar_bytes:
                over = at
    total = BASE_BYTES + const[0] + 2 * text_bytes
    targets = {node.ref for node in nodes if node.ref is not None}
    for t in targets:
        total += const[t] + coeff[t] * nodes[t].ref_name
    if total > max_grammar_bytes:
        raise graph.fail(max(over, 0), "", f"would expand to a grammar of about {min(total, _BIG)} bytes; "
                         f"at most {max_grammar_bytes} are allowed.")
    return total


def _live(node: Node, live: list[int]) -> int:
    """Alternatives open at one point inside the subschema (an upper bound): a branch's
    add up, a sequence's (properties, items) are open one at a time. Edges back into
    the component not summed yet count 0 (recursion is refused where it would multiply)."""
    if not node.edges:
        return node.open
    if node.edges[0][1] in ("alt", "ref"):
        return min(_BIG, sum(live[to] for to, _, _ in node.edges))
    return max(node.open, max(live[to] for to, _, _ in node.edges))


def _cost(node: Node, const: list[int], coeff: list[int]) -> tuple[int, int]:
    """The subschema's grammar bytes as ``const + coeff * len(name it is visited under)``:
    every rule name inside starts with that name. A $ref's target is counted once, apart."""
    k = node.names + node.repeats
    c = RULE_BYTES + NAME_BYTES * node.names + REPEAT_BYTES * node.repeats + CHAR_BYTES * node.chars
    for to, kind, suffix in node.edges:
        if kind == "ref":  # ``name ::= target``
            c += NAME_BYTES + node.ref_name
            continue
        mentions = MENTIONS[kind]  # of the child's names (its -kv and -rest rules for a property)
        c += const[to] + coeff[to] * suffix + mentions * (suffix + NAME_BYTES)
        k += coeff[to] + mentions
    return min(c, _BIG), min(k, _BIG)

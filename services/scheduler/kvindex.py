"""Which KV blocks each engine holds, rebuilt from the engines' block events, and how
each engine names its blocks (its hash scheme). Pure; the basis for KV-cache-aware
endpoint picking: hash a request's tokens as each engine would, and the engine holding
the longest prefix wins."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from llmesh.kvhash import HashScheme


class KvIndex:
    def __init__(self):
        self._blocks: dict[str, set[int]] = {}
        self._schemes: dict[str, HashScheme | None] = {}

    def apply(self, endpoint_id: str, events: Iterable[tuple[str, Sequence[int]]]) -> None:
        """``events``: (kind, hashes) with kind "stored", "removed" or "cleared", in order."""
        blocks = self._blocks.setdefault(endpoint_id, set())
        for kind, hashes in events:
            if kind == "cleared":
                blocks.clear()
            elif kind == "stored":
                blocks.update(hashes)
            elif kind == "removed":
                blocks.difference_update(hashes)

    def set_scheme(self, endpoint_id: str, scheme: HashScheme | None) -> None:
        self._schemes[endpoint_id] = scheme

    def scheme(self, endpoint_id: str) -> HashScheme | None:
        return self._schemes.get(endpoint_id)

    def forget(self, endpoint_id: str) -> None:
        self._blocks.pop(endpoint_id, None)
        self._schemes.pop(endpoint_id, None)

    def count(self, endpoint_id: str) -> int:
        return len(self._blocks.get(endpoint_id, ()))

    def prefix_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """For a request's chained block hashes: how many leading blocks each engine holds."""
        return {eid: _leading(hashes, blocks) for eid, blocks in self._blocks.items()}

    def prefix_tokens(self, tokens: Sequence[int], endpoints: Iterable[str] | None = None,
                      lora: tuple[str, str] | None = None) -> dict[str, int]:
        """For a request's tokens: how many leading tokens each engine (of ``endpoints``,
        default all) holds in its KV cache, each hashed with that engine's own scheme
        (engines with no known scheme hold none). Comparable across schemes."""
        out, memo = {}, {}
        for eid in self._blocks if endpoints is None else endpoints:
            scheme = self._schemes.get(eid)
            if scheme is None:
                out[eid] = 0
                continue
            if scheme not in memo:
                memo[scheme] = scheme.block_hashes(tokens, lora)
            out[eid] = _leading(memo[scheme], self._blocks.get(eid, ())) * scheme.block_size
        return out


def _leading(hashes: Sequence[int], blocks) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in blocks:
        n += 1
    return n

"""Which KV blocks each engine holds, rebuilt from the engines' block events. Pure;
the basis for KV-cache-aware endpoint picking (the longest cached prefix wins)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KvIndex:
    def __init__(self):
        self._blocks: dict[str, set[int]] = {}

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

    def forget(self, endpoint_id: str) -> None:
        self._blocks.pop(endpoint_id, None)

    def count(self, endpoint_id: str) -> int:
        return len(self._blocks.get(endpoint_id, ()))

    def prefix_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """For a request's chained block hashes: how many leading blocks each engine holds."""
        out = {}
        for eid, blocks in self._blocks.items():
            n = 0
            while n < len(hashes) and hashes[n] in blocks:
                n += 1
            out[eid] = n
        return out

    def held(self, endpoint_id: str) -> frozenset[int]:
        """Every block the engine holds (a gateway's resync)."""
        return frozenset(self._blocks.get(endpoint_id, ()))

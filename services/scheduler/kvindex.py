"""Which KV blocks each engine holds, rebuilt from the engines' block events, and how
each engine names its blocks (its hash scheme). Pure; what the scheduler pushes to
gateways for KV-cache-aware endpoint picking (a gateway hashes a request's tokens as
each engine would, and the engine holding the longest prefix wins)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from llmesh.kvhash import HashScheme


class KvIndex:
    def __init__(self) -> None:
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

    def held(self, endpoint_id: str) -> frozenset[int]:
        """Every block the engine holds (a gateway's resync)."""
        return frozenset(self._blocks.get(endpoint_id, ()))


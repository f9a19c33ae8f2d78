"""The gateway's copy of which KV blocks each engine holds, kept by the deltas the
scheduler streams (a resync replaces an engine's set)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KvView:
    def __init__(self):
        self._blocks: dict[str, set[int]] = {}

    def apply(self, endpoint_id: str, resync: bool, stored: Iterable[int], removed: Iterable[int]) -> None:
        if resync:
            self._blocks.pop(endpoint_id, None)
        blocks = self._blocks.setdefault(endpoint_id, set())
        blocks.difference_update(removed)
        blocks.update(stored)
        if not blocks:
            del self._blocks[endpoint_id]

    def keep_only(self, endpoint_ids: set[str]) -> None:
        for eid in set(self._blocks) - endpoint_ids:
            del self._blocks[eid]

    def count(self, endpoint_id: str) -> int:
        return len(self._blocks.get(endpoint_id, ()))

    def matched(self, endpoint_id: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, the engine holds."""
        blocks = self._blocks.get(endpoint_id)
        if not blocks:
            return 0
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        return n

"""The gateway's copy of which KV blocks each engine holds, kept by the deltas the
scheduler streams (a resync replaces an engine's set), plus the blocks of requests
this gateway just sent, expected there until a report can have confirmed them."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence


class KvView:
    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = {}
        self._expected: dict[str, dict[int, float]] = {}  # endpoint -> block -> until when
        self._expiries: deque[tuple[float, str, Sequence[int]]] = deque()

    def expect(self, endpoint_id: str, hashes: Sequence[int], until: float) -> None:
        """A request holding ``hashes`` went there: its engine will hold them once it
        prefills, before its KV events can say so. Counted as held until the engine's
        events store or remove them, or ``until`` (a request that never got there)."""
        held = self._blocks.get(endpoint_id, ())
        hashes = [h for h in hashes if h not in held]  # only what it has yet to store
        if not hashes:
            return
        blocks = self._expected.setdefault(endpoint_id, {})
        for h in hashes:
            blocks[h] = until
        self._expiries.append((until, endpoint_id, hashes))

    def _expire(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            _, eid, hashes = self._expiries.popleft()
            blocks = self._expected.get(eid)
            if blocks is None:
                continue
            for h in hashes:
                if blocks.get(h, now + 1) <= now:
                    del blocks[h]
            if not blocks:
                del self._expected[eid]

    def apply(self, endpoint_id: str, resync: bool, stored: Iterable[int], removed: Iterable[int]) -> None:
        """An engine's KV events: what it says of a block replaces what we expected of it."""
        if resync:
            self._blocks.pop(endpoint_id, None)
        blocks = self._blocks.setdefault(endpoint_id, set())
        expected = self._expected.get(endpoint_id, {})
        for h in removed:
            blocks.discard(h)
            expected.pop(h, None)
        for h in stored:
            blocks.add(h)
            expected.pop(h, None)
        if not blocks:
            del self._blocks[endpoint_id]

    def keep_only(self, endpoint_ids: set[str]) -> None:
        for eid in set(self._blocks) - endpoint_ids:
            del self._blocks[eid]
        for eid in set(self._expected) - endpoint_ids:
            del self._expected[eid]

    def count(self, endpoint_id: str) -> int:
        return len(self._blocks.get(endpoint_id, ()))

    def matched(self, endpoint_id: str, hashes: Sequence[int], now: float | None = None) -> int:
        """How many of ``hashes``, from the first, the engine holds (or, given ``now``,
        is expected to hold)."""
        blocks = self._blocks.get(endpoint_id, ())
        expected: dict[int, float] = {}
        if now is not None:
            self._expire(now)
            expected = self._expected.get(endpoint_id, expected)
        n = 0
        while n < len(hashes) and (hashes[n] in blocks or hashes[n] in expected):
            n += 1
        return n

"""The KV-block changes gateways need for prefix-aware picking, as a bounded log
with sequence numbers: each watch stream keeps a cursor and gets the changes since
it, folded per engine; a watcher the log has moved past gets a full resync. Pure."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockDelta:
    resync: bool = False
    stored: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)


class KvChangeLog:
    def __init__(self, max_hashes: int = 1_000_000):
        self._entries: deque[tuple[int, str, str, tuple[int, ...]]] = deque()
        self._next = 0
        self._hashes = 0
        self._max = max_hashes

    @property
    def cursor(self) -> int:
        """Where a watcher that has just resynced starts."""
        return self._next

    def record(self, endpoint_id: str, events: Iterable[tuple[str, Sequence[int]]]) -> None:
        for kind, hashes in events:
            if kind in ("stored", "removed", "cleared"):
                self._append(endpoint_id, kind, tuple(hashes))

    def forget(self, endpoint_id: str) -> None:
        self._append(endpoint_id, "cleared", ())

    def since(self, cursor: int) -> tuple[dict[str, BlockDelta], int] | None:
        """The changes from ``cursor`` folded per engine, and the new cursor; None when
        the log no longer reaches back that far (resync)."""
        first = self._entries[0][0] if self._entries else self._next
        if cursor < first:
            return None
        out: dict[str, BlockDelta] = {}
        for seq, eid, kind, hashes in self._entries:
            if seq < cursor:
                continue
            d = out.setdefault(eid, BlockDelta())
            if kind == "cleared":
                d.resync = True
                d.stored.clear()
                d.removed.clear()
            elif kind == "stored":
                d.stored.update(hashes)
                d.removed.difference_update(hashes)
            else:
                d.removed.update(hashes)
                d.stored.difference_update(hashes)
        return out, self._next

    def _append(self, endpoint_id: str, kind: str, hashes: tuple[int, ...]) -> None:
        self._entries.append((self._next, endpoint_id, kind, hashes))
        self._next += 1
        self._hashes += len(hashes) + 1
        while self._hashes > self._max and len(self._entries) > 1:
            self._hashes -= len(self._entries.popleft()[3]) + 1

"""KV-cache blocks as a router sees them: fixed-size token blocks named by chained
hashes (a block's hash covers its tokens and its parent's hash, as in vLLM's prefix
caching), and the events an engine publishes when blocks appear or go.

Pure and thread-safe: the llama.cpp decode thread and the event loop both call it."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from llmesh.kvhash import LLMESH_BLOCK_SIZE as BLOCK_SIZE
from llmesh.kvhash import HashScheme, chain_hashes

__all__ = ["BLOCK_SIZE", "BlockLedger", "KvEvent", "KvEventLog", "chain_hashes"]


@dataclass(frozen=True, slots=True)
class KvEvent:
    kind: str                 # "stored", "removed" or "cleared" (everything is gone)
    hashes: tuple[int, ...] = ()


class KvEventLog:
    """The blocks present in one engine's KV cache, and the events not yet sent. Past
    ``max_pending`` unsent events (an engine with no scheduler, a long outage) they are
    dropped and the next ``take_events`` answers with a resync instead."""

    def __init__(self, max_pending: int = 10_000, scheme: HashScheme | None = None):
        self.scheme = scheme  # how the hashes are computed (the engine's, reported with them)
        self._present: dict[int, None] = {}
        self._events: list[KvEvent] = []
        self._max_pending = max_pending
        self._overflowed = False
        self._lock = threading.Lock()

    @property
    def present(self) -> int:
        return len(self._present)

    def stored(self, hashes: Sequence[int]) -> None:
        with self._lock:
            self._present.update(dict.fromkeys(hashes))
            self._append(KvEvent("stored", tuple(hashes)))

    def removed(self, hashes: Sequence[int]) -> None:
        with self._lock:
            for h in hashes:
                self._present.pop(h, None)
            self._append(KvEvent("removed", tuple(hashes)))

    def cleared(self) -> None:
        with self._lock:
            self._present.clear()
            self._append(KvEvent("cleared"))

    def take_events(self) -> list[KvEvent]:
        with self._lock:
            if self._overflowed:
                return self._snapshot()
            events, self._events = self._events, []
            return events

    def resync(self) -> list[KvEvent]:
        """For a new subscriber: 'cleared', then every block present now. Pending
        events are dropped: the snapshot already includes them."""
        with self._lock:
            return self._snapshot()

    def _append(self, event: KvEvent) -> None:
        if len(self._events) >= self._max_pending:
            self._events, self._overflowed = [], True
        if not self._overflowed:
            self._events.append(event)

    def _snapshot(self) -> list[KvEvent]:
        self._events, self._overflowed = [], False
        present = tuple(self._present)
        return [KvEvent("cleared")] + ([KvEvent("stored", present)] if present else [])


class BlockLedger:
    """Which full blocks each owner (a sequence or a KV slot) holds. A block two owners
    share is stored once and removed when the last lets go, unless ``keep_released``,
    where it stays cached (evictable, least recently released first) as in vLLM. As vLLM
    frees a request's blocks (its prefix-caching design notes), an owner's blocks join the
    cache tail first: the last block covers the most tokens, is the least likely to be
    shared, and goes first, so a shared prefix outlives the histories behind it."""

    def __init__(self, block_size: int = BLOCK_SIZE, keep_released: bool = False):
        self.block_size = block_size
        self._keep = keep_released
        self._owned: dict[Hashable, list[int]] = {}
        self._refs: Counter[int] = Counter()
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0, still in the KV cache
        self.log = KvEventLog(scheme=HashScheme("llmesh", block_size))
        self._lock = threading.Lock()

    def hold(self, owner: Hashable, tokens: Sequence[int], hashes: list[int] | None = None) -> int:
        """``owner`` now holds exactly ``tokens`` (``hashes``: their ``chain_hashes``, where the
        caller has them); returns how many leading tokens were already cached or held by others
        (the prefix a prefill can skip)."""
        new = chain_hashes(tokens, self.block_size) if hashes is None else hashes
        with self._lock:
            held = self._owned.setdefault(owner, [])
            keep = 0
            while keep < min(len(held), len(new)) and held[keep] == new[keep]:
                keep += 1
            self._unref(held[keep:])
            del held[keep:]
            hits = self._present(new)  # at least keep: those are held
            self._ref(new[keep:])
            held.extend(new[keep:])
            return hits * self.block_size

    def present(self, hashes: list[int]) -> tuple[int, frozenset[int]]:
        """Without changing anything: how many leading blocks of a prompt (its ``chain_hashes``)
        are held or cached, and which of those are only cached (evicting them would lose the hit)."""
        with self._lock:
            n = self._present(hashes)
            return n, frozenset(h for h in hashes[:n] if h in self._cached)

    def _present(self, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and (self._refs[hashes[n]] > 0 or hashes[n] in self._cached):
            n += 1
        return n

    def grow(self, owner: Hashable, tokens: Sequence[int]) -> None:
        """``tokens`` extends what ``owner`` held; records any block it completed."""
        with self._lock:
            held = self._owned.setdefault(owner, [])
            full = len(tokens) // self.block_size
            if full <= len(held):
                return
            parent = held[-1] if held else 0
            new = chain_hashes(tokens[len(held) * self.block_size:full * self.block_size], self.block_size, parent)
            self._ref(new)
            held.extend(new)

    def release(self, owner: Hashable) -> None:
        with self._lock:
            self._unref(self._owned.pop(owner, []))

    def owned(self, owner: Hashable) -> int:
        """How many full blocks ``owner`` holds (shared ones included)."""
        with self._lock:
            return len(self._owned.get(owner, ()))

    def evict(self, n: int, spare: frozenset[int] = frozenset()) -> int:
        """Drops up to ``n`` cached blocks, least recently released first, never one in ``spare``."""
        with self._lock:
            gone: list[int] = []
            for h in self._cached:
                if len(gone) >= n:
                    break
                if h not in spare:
                    gone.append(h)
            for h in gone:
                del self._cached[h]
            if gone:
                self.log.removed(gone)
            return len(gone)

    @property
    def scheme(self) -> HashScheme | None:
        return self.log.scheme

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def held_blocks(self) -> int:
        """Distinct blocks some owner holds (a block two owners share counts once)."""
        return len(self._refs)

    def take_events(self) -> list[KvEvent]:
        return self.log.take_events()

    def resync(self) -> list[KvEvent]:
        return self.log.resync()

    def _ref(self, hashes: list[int]) -> None:
        fresh: list[int] = []
        for h in hashes:
            if self._refs[h] == 0 and h not in self._cached:
                fresh.append(h)
            self._cached.pop(h, None)  # cached -> held again
            self._refs[h] += 1
        if fresh:
            self.log.stored(fresh)

    def _unref(self, hashes: list[int]) -> None:
        gone = []
        for h in reversed(hashes):  # the tail first (see the class)
            self._refs[h] -= 1
            if self._refs[h] <= 0:
                del self._refs[h]
                if self._keep:
                    self._cached[h] = None
                else:
                    gone.append(h)
        if gone:
            self.log.removed(gone)

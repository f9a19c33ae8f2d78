"""The in-process store (`make run`'s default): per tenant an LRU of entries with a
time to live. Nothing survives a restart and nothing is shared between processes."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from llmesh.cache.store import Entry, Name, Selector, Stored, TenantStats


class MemoryStore:
    backend = "memory"

    def __init__(self, max_entries_per_tenant: int, clock: Callable[[], float] = time.monotonic):
        self._max = max_entries_per_tenant
        self._clock = clock
        self._tenants: dict[str, OrderedDict[Name, tuple[float, Entry]]] = {}
        self._stats: dict[str, TenantStats] = {}

    def _live(self, tenant: str) -> OrderedDict[Name, tuple[float, Entry]]:
        return self._tenants.setdefault(tenant, OrderedDict())

    async def get(self, name: Name) -> Entry | None:
        entries = self._tenants.get(name.tenant)
        item = entries.get(name) if entries else None
        if entries is None or item is None:
            return None
        expires, entry = item
        if expires <= self._clock():
            del entries[name]
            return None
        entries.move_to_end(name)
        return entry

    async def put(self, name: Name, entry: Entry, ttl_s: float) -> list[Name]:
        entries = self._live(name.tenant)
        entries[name] = (self._clock() + ttl_s, entry)
        entries.move_to_end(name)
        evicted = []
        while len(entries) > self._max:
            evicted.append(entries.popitem(last=False)[0])
        stats = self._stats.setdefault(name.tenant, TenantStats())
        stats.stores += 1
        stats.evictions += len(evicted)
        return evicted

    async def count(self, tenant: str, counter: str, n: int = 1) -> None:
        stats = self._stats.setdefault(tenant, TenantStats())
        setattr(stats, counter, getattr(stats, counter) + n)

    async def invalidate(self, selector: Selector) -> list[Name]:
        removed = []
        tenants = [selector.tenant] if selector.tenant is not None else list(self._tenants)
        for tenant in tenants:
            entries = self._tenants.get(tenant, OrderedDict())
            for name in [n for n in entries if selector.matches(n)]:
                del entries[name]
                removed.append(name)
        return removed

    def _prune(self, tenant: str) -> None:
        now = self._clock()
        entries = self._tenants.get(tenant, OrderedDict())
        for name in [n for n, (expires, _) in entries.items() if expires <= now]:
            del entries[name]

    async def stats(self, tenant: str | None = None) -> dict[str, TenantStats]:
        out = {}
        for t in ([tenant] if tenant is not None else sorted(set(self._tenants) | set(self._stats))):
            self._prune(t)
            s = self._stats.get(t, TenantStats())
            out[t] = TenantStats(len(self._tenants.get(t, {})), s.hits, s.semantic_hits, s.misses, s.stores,
                                 s.evictions)
        return out

    async def semantic_entries(self) -> AsyncIterator[Stored]:
        now = self._clock()
        for entries in list(self._tenants.values()):
            for name, (expires, entry) in list(entries.items()):
                if name.kind == "s" and expires > now:
                    yield Stored(name, entry, expires - now)

    async def watch_semantic(self) -> AsyncIterator[Stored | None]:
        yield None  # one process: nothing is stored behind its back

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

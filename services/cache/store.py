"""The storage interface both stores implement (in-process, Redis): entries with a
time to live, a least-recently-used cap per tenant, invalidation and counters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

Kind = Literal["x", "s"]  # exact, semantic


@dataclass(frozen=True, slots=True)
class Name:
    """Where an entry lives: tenant and model make invalidation by either cheap."""
    tenant: str
    model: str
    kind: Kind
    digest: str


@dataclass(frozen=True, slots=True)
class Entry:
    response: bytes            # a serialised llmesh.v1.CachedResponse
    vector: bytes = b""        # semantic entries: the float32 embedding of ``text``
    text: str = ""             # semantic entries: the (masked) last user turn, for the guards
    scope: str = ""            # semantic entries: the digest of everything but that turn


@dataclass(frozen=True, slots=True)
class Stored:
    """A semantic entry as read back to rebuild the index."""
    name: Name
    entry: Entry
    ttl_left_s: float


@dataclass(slots=True)
class TenantStats:
    entries: int = 0
    hits: int = 0
    semantic_hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0

    COUNTERS = ("hits", "semantic_hits", "misses", "stores", "evictions")


@dataclass(frozen=True, slots=True)
class Selector:
    """Which entries an invalidation removes: every filter given must match."""
    tenant: str | None = None
    model: str | None = None
    prefix: str = ""  # of the entry's key digest (as logged and returned on hits)

    def matches(self, name: Name) -> bool:
        return ((self.tenant is None or name.tenant == self.tenant)
                and (self.model is None or name.model == self.model)
                and name.digest.startswith(self.prefix))


class Store(Protocol):
    backend: str

    async def get(self, name: Name) -> Entry | None:
        """The live entry (and it becomes the most recently used), or None."""

    async def put(self, name: Name, entry: Entry, ttl_s: float) -> list[Name]:
        """Store; returns the entries evicted to keep the tenant under its cap."""

    async def count(self, tenant: str, counter: str, n: int = 1) -> None:
        """Add to one of TenantStats.COUNTERS."""

    async def invalidate(self, selector: Selector) -> list[Name]:
        """Remove matching entries; returns their names."""

    async def stats(self, tenant: str | None = None) -> dict[str, TenantStats]:
        ...

    def semantic_entries(self) -> AsyncIterator[Stored]:
        """Every live semantic entry, to rebuild the nearest-neighbour index."""

    def watch_semantic(self) -> AsyncIterator[Stored | None]:
        """Semantic entries as any process stores them. Yields None first, once it
        listens: what was stored before is then read with semantic_entries()."""

    async def ping(self) -> None:
        ...

    async def close(self) -> None:
        ...

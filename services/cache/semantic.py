"""The semantic side: embeddings of last user turns, one nearest-neighbour index per
scope (which names the embedder: ``keys.embedded_scope``), and the guards a candidate
must pass on top of the cosine threshold."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from llmesh.cache.guards import Features, extract, refusal
from llmesh.cache.index import ScopeIndex
from llmesh.cache.store import Name, Selector


class Embedder(Protocol):
    """Unit-length float32 vectors; ``identity`` names the model and its version (a scope's vectors
    all come from one identity: it is part of the scope)."""
    identity: str

    def encode(self, text: str) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class Candidate:
    name: Name
    similarity: float


@dataclass(slots=True)
class _Indexed:
    name: Name
    scope: str
    features: Features
    expires: float


class SemanticIndex:
    def __init__(self, embedder: Embedder | None, hnsw_min: int = 2000, memo: int = 4096,
                 on_refusal: Callable[[str], None] = lambda guard: None, clock: Callable[[], float] = time.monotonic):
        self.embedder = embedder  # the default one (ResponseCache may choose another per request)
        self._hnsw_min = hnsw_min
        self._on_refusal = on_refusal
        self._clock = clock
        self._scopes: dict[str, ScopeIndex] = {}
        self._entries: dict[int, _Indexed] = {}
        self._labels: dict[Name, int] = {}
        self._next = 1
        # (embedder identity, text) -> vector: a lookup's miss is often stored next
        self._memo: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._memo_max = memo

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: Name) -> bool:
        return name in self._labels

    def embed(self, text: str) -> np.ndarray:
        assert self.embedder is not None, "no default embedder"
        key = (self.embedder.identity, text)
        vector = self.remembered(key)
        if vector is None:
            vector = self.embedder.encode(text)
            self.remember(key, vector)
        return vector

    def remembered(self, key: tuple[str, str]) -> np.ndarray | None:
        """The vector of (embedder identity, text) if it was embedded lately."""
        vector = self._memo.get(key)
        if vector is not None:
            self._memo.move_to_end(key)
        return vector

    def remember(self, key: tuple[str, str], vector: np.ndarray) -> None:
        self._memo[key] = vector
        if len(self._memo) > self._memo_max:
            self._memo.popitem(last=False)

    def add(self, name: Name, scope: str, text: str, vector: np.ndarray, ttl_s: float) -> None:
        self.add_many([(name, scope, text, vector, ttl_s)])

    def add_many(self, items: list[tuple[Name, str, str, np.ndarray, float]]) -> None:
        """Index entries (name, scope, text, vector, ttl_s), a scope's in one batch."""
        now = self._clock()
        batches: dict[str, tuple[list[int], list[np.ndarray]]] = {}
        unique = {item[0]: item for item in items}  # SCAN may return a key twice
        for name, scope, text, vector, ttl_s in unique.values():
            self.remove(name)
            label, self._next = self._next, self._next + 1
            self._entries[label] = _Indexed(name, scope, extract(text), now + ttl_s)
            self._labels[name] = label
            labels, vectors = batches.setdefault(scope, ([], []))
            labels.append(label)
            vectors.append(vector)
        for scope, (labels, vectors) in batches.items():
            index = self._scopes.get(scope)
            if index is None:
                index = self._scopes[scope] = ScopeIndex(self._hnsw_min)
            index.add_many(labels, vectors)

    def remove(self, name: Name) -> None:
        label = self._labels.pop(name, None)
        if label is None:
            return
        entry = self._entries.pop(label)
        index = self._scopes[entry.scope]
        index.remove(label)
        if len(index) == 0:
            del self._scopes[entry.scope]

    def remove_matching(self, selector: Selector) -> int:
        names = [n for n in self._labels if selector.matches(n)]
        for name in names:
            self.remove(name)
        return len(names)

    def sweep(self) -> int:
        now = self._clock()
        expired = [e.name for e in self._entries.values() if e.expires <= now]
        for name in expired:
            self.remove(name)
        return len(expired)

    def search(self, scope: str, text: str, vector: np.ndarray, threshold: float, k: int = 4) -> list[Candidate]:
        """Entries of this scope at or above the threshold that pass every guard, best first."""
        index = self._scopes.get(scope)
        if index is None:
            return []
        now, features, out = self._clock(), None, []
        for match in index.search(vector, k):
            if match.similarity < threshold:
                break
            entry = self._entries.get(match.label)
            if entry is None or entry.expires <= now:
                continue
            features = features or extract(text)
            guard = refusal(features, entry.features)
            if guard is not None:
                self._on_refusal(guard)
                continue
            out.append(Candidate(entry.name, match.similarity))
        return out

"""Nearest neighbours among the semantic entries, one index per scope (tenant, model,
system prompt and earlier turns), so a search never even sees another scope.

A scope's vectors come from one embedder (its identity is part of the scope), so they share
one dimension, whatever it is. A scope searches exactly with numpy while it is small; past ``hnsw_min`` entries it
moves to an HNSW graph (usearch), whose search cost grows with log n instead of n."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from usearch.index import Index


@dataclass(frozen=True, slots=True)
class Match:
    label: int
    similarity: float


class ScopeIndex:
    def __init__(self, hnsw_min: int):
        self._hnsw_min = hnsw_min
        self._labels: list[int] = []
        self._vectors: list[np.ndarray] = []
        self._matrix: np.ndarray | None = None  # stacked _vectors, rebuilt lazily
        self._hnsw: Index | None = None

    def __len__(self) -> int:
        return len(self._hnsw) if self._hnsw is not None else len(self._labels)

    def add(self, label: int, vector: np.ndarray) -> None:
        self.add_many([label], [vector])

    def add_many(self, labels: list[int], vectors: list[np.ndarray]) -> None:
        """One call per batch: HNSW inserts a batch on several threads."""
        if self._hnsw is not None:
            self._hnsw.add(np.asarray(labels, dtype=np.uint64), np.stack(vectors))
            return
        self._labels.extend(labels)
        self._vectors.extend(vectors)
        self._matrix = None
        if len(self._labels) >= self._hnsw_min:
            self._hnsw = Index(ndim=len(self._vectors[0]), metric="cos", dtype="f32", connectivity=16,
                               expansion_add=128, expansion_search=64)
            self._hnsw.add(np.asarray(self._labels, dtype=np.uint64), np.stack(self._vectors))
            self._labels, self._vectors = [], []

    def remove(self, label: int) -> None:
        if self._hnsw is not None:
            self._hnsw.remove(label)
            return
        if label in self._labels:
            i = self._labels.index(label)
            del self._labels[i], self._vectors[i]
            self._matrix = None

    def search(self, vector: np.ndarray, k: int) -> list[Match]:
        if self._hnsw is not None:
            found = self._hnsw.search(vector, k)
            return [Match(int(label), 1.0 - float(dist)) for label, dist in zip(found.keys, found.distances)]
        if not self._labels:
            return []
        if self._matrix is None:
            self._matrix = np.stack(self._vectors)
        sims = self._matrix @ vector
        top = np.argpartition(-sims, k)[:k] if len(sims) > k else np.arange(len(sims))
        top = top[np.argsort(-sims[top])]
        return [Match(self._labels[i], float(sims[i])) for i in top]

"""Cache metrics: hit ratio (hits / lookups, in PromQL) and lookup latency."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.lookups = Counter("llmesh_cache_lookups", "Lookups by result: hit, miss, uncacheable.", ("result",),
                               registry=registry)
        self.stores = Counter("llmesh_cache_stores", "Responses stored.", registry=registry)
        self.latency = Histogram("llmesh_cache_lookup_seconds", "Time to answer a lookup.",
                                 buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1),
                                 registry=registry)
        self.entries = Gauge("llmesh_cache_entries", "Entries held.", registry=registry)

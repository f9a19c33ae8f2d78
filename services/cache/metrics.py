"""Cache metrics: hit ratio (hits / lookups, in PromQL), lookup latency, store
errors (each one a bypass), guard refusals and the semantic index's size."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.lookups = Counter("llmesh_cache_lookups", "Lookups by result: hit_exact, hit_semantic, miss, "
                               "uncacheable, bypass (store unavailable).", ("result",), registry=registry)
        self.late_lookups = Counter("llmesh_cache_late_lookups", "Lookups that ended after their caller had given "
                                    "up (over the gateway's budget: a miss to it), by what they found: hit_exact, "
                                    "hit_semantic, miss; dropped: shed, LATE_MAX late ones were running. A hit "
                                    "here is an answer the budget lost.", ("result",),
                                    registry=registry)
        self.stores = Counter("llmesh_cache_stores", "Responses stored.", registry=registry)
        self.latency = Histogram("llmesh_cache_lookup_seconds", "Time to answer a lookup (a lookup whose "
                                 "caller gave up first is in llmesh_cache_late_lookups instead).",
                                 buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1),
                                 registry=registry)
        self.store_errors = Counter("llmesh_cache_store_errors", "Store calls that failed or ran over budget "
                                    "(the request bypassed the cache).", ("op",), registry=registry)
        self.guard_refusals = Counter("llmesh_cache_guard_refusals", "Semantic candidates above the threshold "
                                      "that a guard refused.", ("guard",), registry=registry)
        self.embed_errors = Counter("llmesh_cache_embed_errors", "Embeddings that failed (an endpoint away, slow "
                                    "or answering badly); the request was matched exactly only.", ("error",),
                                    registry=registry)
        self.verdicts = Counter("llmesh_cache_verdicts", "Semantic candidates' verdicts by stage: guards "
                                "(refused: the guard label of llmesh_cache_guard_refusals; passed), judge (the "
                                "verifier: yes, no, timeout, error).", ("stage", "verdict"), registry=registry)
        self.indexed = Gauge("llmesh_cache_semantic_entries", "Entries in the semantic index.", registry=registry)

"""Cache gRPC servicer: protobuf <-> the ResponseCache domain."""

from __future__ import annotations

import time
from collections.abc import Callable

from llmesh.convert import prompt_from_pb, sampling_from_pb
from llmesh.errors import PermissionDenied
from llmesh.rpc.identity import caller
from llmesh.v1 import cache_pb2, cache_pb2_grpc
from llmesh.cache.keys import Request
from llmesh.cache.metrics import CacheMetrics
from llmesh.cache.responses import ResponseCache
from llmesh.cache.store import Selector

_KIND = {"exact": cache_pb2.HIT_KIND_EXACT, "semantic": cache_pb2.HIT_KIND_SEMANTIC}


def request_from_pb(query: cache_pb2.CacheQuery) -> Request:
    """The query as the domain's; its tenant is taken from a gateway only (the policy lets no other
    service call Lookup/Store: this is the second lock). No caller: local trust, or an in-process test."""
    who = caller.get()
    if who is not None and who.service != "gateway":
        raise PermissionDenied(f"only a gateway may name a tenant; the caller is the {who.service} service",
                               reason="service_not_allowed")
    return Request(tenant=query.tenant, model=query.model, prompt=prompt_from_pb(query),
                   sampling=sampling_from_pb(query.sampling), model_version=query.model_version)


class CacheServicer(cache_pb2_grpc.CacheServicer):
    def __init__(self, cache: ResponseCache, metrics: CacheMetrics, backend: str,
                 available: Callable[[], bool] = lambda: True):
        self._cache = cache
        self._metrics = metrics
        self._backend = backend
        self._available = available

    async def Lookup(self, request, context):
        start = time.perf_counter()  # answered lookups only: one its caller gave up on is counted late instead
        hit = await self._cache.lookup(request_from_pb(request.query),
                                       request.min_similarity if request.HasField("min_similarity") else None)
        self._metrics.latency.observe(time.perf_counter() - start)
        if hit is None:
            return cache_pb2.LookupResponse(hit=False)
        return cache_pb2.LookupResponse(hit=True, response=cache_pb2.CachedResponse.FromString(hit.response),
                                        kind=_KIND[hit.kind], similarity=hit.similarity, key=hit.key,
                                        loosened=hit.loosened)

    async def Store(self, request, context):
        stored = await self._cache.store(request_from_pb(request.query), request.response.SerializeToString())
        if stored:
            self._metrics.stores.inc()
        self._metrics.indexed.set(self._cache.semantic_indexed)
        return cache_pb2.StoreResponse(stored=stored)

    async def Invalidate(self, request, context):
        removed = await self._cache.invalidate(Selector(
            tenant=request.tenant if request.HasField("tenant") else None,
            model=request.model if request.HasField("model") else None, prefix=request.key_prefix), request.all)
        self._metrics.indexed.set(self._cache.semantic_indexed)
        return cache_pb2.InvalidateResponse(removed=removed)

    async def Stats(self, request, context):
        stats = await self._cache.stats(request.tenant if request.HasField("tenant") else None)
        return cache_pb2.StatsResponse(
            backend=self._backend, backend_available=self._available(), semantic_indexed=self._cache.semantic_indexed,
            tenants=[cache_pb2.TenantStats(tenant=t, entries=s.entries, hits=s.hits, semantic_hits=s.semantic_hits,
                                           misses=s.misses, stores=s.stores, evictions=s.evictions)
                     for t, s in stats.items()])

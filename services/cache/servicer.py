"""Cache gRPC servicer: protobuf <-> key derivation and store."""

from __future__ import annotations

from llmesh.convert import prompt_from_pb, sampling_from_pb
from llmesh.v1 import cache_pb2, cache_pb2_grpc
from llmesh.cache.keys import cacheable, exact_key
from llmesh.cache.memory import LruTtlStore
from llmesh.cache.metrics import CacheMetrics


class CacheServicer(cache_pb2_grpc.CacheServicer):
    def __init__(self, store: LruTtlStore[bytes], metrics: CacheMetrics):
        self._store = store
        self._metrics = metrics

    @staticmethod
    def _key(query: cache_pb2.CacheQuery) -> str | None:
        sampling = sampling_from_pb(query.sampling)
        if not cacheable(sampling):
            return None
        return exact_key(query.tenant, query.model, prompt_from_pb(query), sampling)

    async def Lookup(self, request, context):
        with self._metrics.latency.time():
            key = self._key(request.query)
            blob = self._store.get(key) if key else None
        self._metrics.lookups.labels("uncacheable" if key is None else "miss" if blob is None else "hit").inc()
        if blob is None:
            return cache_pb2.LookupResponse(hit=False)
        return cache_pb2.LookupResponse(hit=True, response=cache_pb2.CachedResponse.FromString(blob))

    async def Store(self, request, context):
        key = self._key(request.query)
        if key is None:
            return cache_pb2.StoreResponse(stored=False)
        self._store.put(key, request.response.SerializeToString())
        self._metrics.stores.inc()
        self._metrics.entries.set(len(self._store))
        return cache_pb2.StoreResponse(stored=True)

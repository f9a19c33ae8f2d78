"""The cache service's gRPC client, behind the cache stage's port (Lookup, Store)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from opentelemetry.trace import NoOpTracer, Span, SpanKind, Tracer

from llmesh.convert import finish_from_pb, finish_to_pb, prompt_fields, sampling_to_pb, usage_from_pb, usage_to_pb
from llmesh.discovery.base import NoInstance, Resolver
from llmesh.errors import DiscoveryError
from llmesh.liveconfig.schema import MeshConfig
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import Identity
from llmesh.rpc.interceptor import REQUEST_ID_KEY
from llmesh.telemetry import child_context, inject
from llmesh.types import Finish
from llmesh.v1 import cache_pb2, cache_pb2_grpc
from llmesh.gateway.context import CacheHit, CompletionRequest
from llmesh.gateway.upstream.rpc import why

log = logging.getLogger("llmesh.gateway.upstreams")


class CacheClient:
    """The response cache; a failing cache never fails a request, it only misses.
    A lookup has ``budget_s`` (a slow cache is a miss, not a slower answer); stores
    run after the answer, off the request path. The cache's address is looked up
    when first needed and again after the cache was unreachable."""

    def __init__(self, resolve: Resolver, budget_s: float = 0.02, tracer: Tracer | None = None,
                 store_timeout_s: float = 2.0, config: Callable[[], MeshConfig] = MeshConfig,
                 identity: Identity | None = None):
        self._resolve = resolve
        self._identity = identity
        self._config = config
        self._tracer = tracer or NoOpTracer()
        self._channel: grpc.aio.Channel | None = None
        self._stub: cache_pb2_grpc.CacheStub | None = None
        self._timeout = budget_s
        self._store_timeout = store_timeout_s
        self._closing: set[asyncio.Task] = set()

    def applies(self, req: CompletionRequest) -> bool:
        """The live config's cache section: on for this tenant and model, and the
        request deterministic (or the tenant caches sampled answers too)."""
        return self._config().cache.applies(req.tenant, req.model, req.sampling.deterministic)

    async def _cache(self) -> cache_pb2_grpc.CacheStub:
        if self._stub is None:
            try:  # on the request path: never wait on discovery longer than on the cache itself
                address = await asyncio.wait_for(self._resolve(), self._timeout)
            except TimeoutError:
                raise NoInstance("cache", "known yet") from None
            self._channel = mesh_channel(address, "cache", self._identity)
            self._stub = cache_pb2_grpc.CacheStub(self._channel)
        return self._stub

    async def _forget_if_gone(self, exc: Exception) -> None:
        """A lookup over budget keeps its channel (reconnecting costs more); an
        unreachable cache is looked up again next time."""
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            # Closing at once would cancel the calls still on it (their requests would fail):
            # they get until the store timeout to finish.
            task = asyncio.create_task(channel.close(grace=self._store_timeout))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _forget(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    @staticmethod
    def _query(req: CompletionRequest) -> cache_pb2.CacheQuery:
        return cache_pb2.CacheQuery(tenant=req.tenant, model=req.model, sampling=sampling_to_pb(req.sampling),
                                    **prompt_fields(req.prompt, cache_pb2.CachedChat))

    async def lookup(self, req: CompletionRequest, parent: Span, min_similarity: float | None = None
                     ) -> CacheHit | None:
        with self._tracer.start_as_current_span("llmesh.v1.Cache/Lookup", context=child_context(parent),
                                                kind=SpanKind.CLIENT) as span:
            try:
                stub = await self._cache()
                resp = await stub.Lookup(cache_pb2.LookupRequest(query=self._query(req), min_similarity=min_similarity),
                                         timeout=self._timeout,
                                         metadata=((REQUEST_ID_KEY, req.request_id), *inject(span)))
            except (grpc.aio.AioRpcError, DiscoveryError) as exc:
                log.warning("cache lookup failed", extra={"error": why(exc)})
                await self._forget_if_gone(exc)
                return None
            span.set_attribute("llmesh.cache.hit", resp.hit)
        if not resp.hit:
            return None
        r = resp.response
        kind = "semantic" if resp.kind == cache_pb2.HIT_KIND_SEMANTIC else "exact"
        return CacheHit(r.text, Finish(reason=finish_from_pb(r.finish_reason), usage=usage_from_pb(r.usage)), kind,
                        resp.loosened)

    async def store(self, req: CompletionRequest, text: str, finish: Finish, parent: Span) -> None:
        response = cache_pb2.CachedResponse(text=text, finish_reason=finish_to_pb(finish.reason),
                                            usage=usage_to_pb(finish.usage))
        try:
            stub = await self._cache()
            await stub.Store(cache_pb2.StoreRequest(query=self._query(req), response=response),
                             timeout=self._store_timeout, metadata=((REQUEST_ID_KEY, req.request_id),))
        except (grpc.aio.AioRpcError, DiscoveryError) as exc:
            log.warning("cache store failed", extra={"error": why(exc)})
            await self._forget_if_gone(exc)

    async def close(self) -> None:
        await self._forget()
        await asyncio.gather(*self._closing, return_exceptions=True)

"""gRPC adapters behind the pipeline's ports, and the background feeds that keep
the gateway's view of the mesh current (scheduler stream, model catalog)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from llmesh.convert import (finish_from_pb, finish_to_pb, kv_hash_from_pb, logprobs_from_pb, priority_to_pb,
                            prompt_fields, sampling_to_pb, usage_from_pb, usage_to_pb)
from opentelemetry.trace import NoOpTracer, Span, SpanKind, Status, StatusCode, Tracer

from llmesh.discovery.base import NoInstance, Resolver
from llmesh.errors import DiscoveryError, Unavailable
from llmesh.liveconfig.schema import MeshConfig
from llmesh.telemetry import child_context, inject
from llmesh.rpc.channels import insecure_channel
from llmesh.rpc.interceptor import REQUEST_ID_KEY
from llmesh.rpc.status import from_rpc_error
from llmesh.types import Delta, Finish
from llmesh.v1 import (cache_pb2, cache_pb2_grpc, engine_pb2, engine_pb2_grpc, modelmgr_pb2,
                       modelmgr_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc)
from llmesh.gateway.picking import Endpoint, EndpointPicker
from llmesh.gateway.pipeline import CompletionRequest

log = logging.getLogger("llmesh.gateway.upstreams")


class EngineClients:
    """One channel per engine address, opened on first use."""

    def __init__(self, tracer: Tracer | None = None) -> None:
        self._tracer = tracer or NoOpTracer()
        self._stubs: dict[str, tuple[grpc.aio.Channel, engine_pb2_grpc.EngineStub]] = {}

    def _stub(self, address: str) -> engine_pb2_grpc.EngineStub:
        entry = self._stubs.get(address)
        if entry is None:
            channel = insecure_channel(address)
            entry = self._stubs[address] = (channel, engine_pb2_grpc.EngineStub(channel))
        return entry[1]

    async def generate(self, address: str, req: CompletionRequest, timeout_s: float, parent: Span
                       ) -> AsyncIterator[Delta | Finish]:
        request = engine_pb2.GenerateRequest(
            request_id=req.request_id, model=req.model, sampling=sampling_to_pb(req.sampling),
            priority=priority_to_pb(req.priority), continuation=req.continuation, whole=not req.stream,
            **prompt_fields(req.prompt, engine_pb2.ChatInput))
        span = self._tracer.start_span("llmesh.v1.Engine/Generate", context=child_context(parent),
                                       kind=SpanKind.CLIENT, attributes={"server.address": address})
        call = self._stub(address).Generate(request, timeout=timeout_s,
                                            metadata=((REQUEST_ID_KEY, req.request_id), *inject(span)))
        try:
            async for resp in call:
                if resp.text or resp.token_count or resp.logprobs:  # the last may carry text too (whole)
                    yield Delta(text=resp.text, tokens=resp.token_count,
                                logprobs=logprobs_from_pb(resp.logprobs) if resp.logprobs else ())
                if resp.finish_reason:
                    yield Finish(reason=finish_from_pb(resp.finish_reason), usage=usage_from_pb(resp.usage))
        except grpc.aio.AioRpcError as exc:
            span.set_status(Status(StatusCode.ERROR, exc.code().name))
            if exc.code() == grpc.StatusCode.CANCELLED:
                # Our own cancel arrives as asyncio.CancelledError; this one is the engine's (a server
                # stopping cancels what it still holds): the engine is going away, try another.
                raise Unavailable(f"The engine at {address} cancelled the call.", reason="engine_cancelled") from None
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()  # no-op once finished; frees the engine's slot if we stop early
            span.end()

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


class CacheClient:
    """The response cache; a failing cache never fails a request, it only misses.
    A lookup has ``budget_s`` (a slow cache is a miss, not a slower answer); stores
    run after the answer, off the request path. The cache's address is looked up
    when first needed and again after the cache was unreachable."""

    def __init__(self, resolve: Resolver, budget_s: float = 0.02, tracer: Tracer | None = None,
                 store_timeout_s: float = 2.0, config: Callable[[], MeshConfig] = MeshConfig):
        self._resolve = resolve
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
            self._channel = insecure_channel(address)
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

    async def lookup(self, req: CompletionRequest, parent: Span) -> tuple[str, Finish] | None:
        with self._tracer.start_as_current_span("llmesh.v1.Cache/Lookup", context=child_context(parent),
                                                kind=SpanKind.CLIENT) as span:
            try:
                stub = await self._cache()
                resp = await stub.Lookup(cache_pb2.LookupRequest(query=self._query(req)), timeout=self._timeout,
                                         metadata=((REQUEST_ID_KEY, req.request_id), *inject(span)))
            except (grpc.aio.AioRpcError, DiscoveryError) as exc:
                log.warning("cache lookup failed", extra={"error": _why(exc)})
                await self._forget_if_gone(exc)
                return None
            span.set_attribute("llmesh.cache.hit", resp.hit)
        if not resp.hit:
            return None
        r = resp.response
        return r.text, Finish(reason=finish_from_pb(r.finish_reason), usage=usage_from_pb(r.usage))

    async def store(self, req: CompletionRequest, text: str, finish: Finish, parent: Span) -> None:
        response = cache_pb2.CachedResponse(text=text, finish_reason=finish_to_pb(finish.reason),
                                            usage=usage_to_pb(finish.usage))
        try:
            stub = await self._cache()
            await stub.Store(cache_pb2.StoreRequest(query=self._query(req), response=response),
                             timeout=self._store_timeout, metadata=((REQUEST_ID_KEY, req.request_id),))
        except (grpc.aio.AioRpcError, DiscoveryError) as exc:
            log.warning("cache store failed", extra={"error": _why(exc)})
            await self._forget_if_gone(exc)

    async def close(self) -> None:
        await self._forget()
        await asyncio.gather(*self._closing, return_exceptions=True)


def _why(exc: Exception) -> str:
    return exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)


def endpoint_from_pb(e: scheduler_pb2.Endpoint) -> Endpoint:
    return Endpoint(endpoint_id=e.endpoint_id, address=e.address, models=frozenset(e.models),
                    running=e.load.running, waiting=e.load.waiting, max_running=e.load.max_running,
                    healthy=e.healthy, degraded=e.degraded,
                    kv_hash=kv_hash_from_pb(e.kv_hash) if e.HasField("kv_hash") else None,
                    context={s.name: s.context_length for s in e.served if s.context_length},
                    adapters={s.name: s.in_flight for s in e.served if s.base_model})


class SchedulerFeed:
    """Keeps the picker's table current from the scheduler's WatchEndpoints stream.
    If the scheduler goes away, the last known table stays in use."""

    def __init__(self, resolve: Resolver, picker: EndpointPicker):
        self._resolve = resolve
        self._picker = picker

    async def run(self) -> None:
        backoff = 0.2
        while True:
            address = "?"
            try:
                address = await self._resolve()  # anew on every (re)connect
                async with insecure_channel(address) as channel:
                    stub = scheduler_pb2_grpc.SchedulerStub(channel)
                    async for table in stub.WatchEndpoints(scheduler_pb2.WatchEndpointsRequest()):
                        self._picker.replace_all(endpoint_from_pb(e) for e in table.endpoints)
                        for b in table.kv:
                            self._picker.kv.apply(b.endpoint_id, b.resync, b.stored, b.removed)
                        backoff = 0.2
            except (grpc.aio.AioRpcError, DiscoveryError) as exc:
                log.warning("scheduler stream broke; keeping the last endpoint table",
                            extra={"scheduler": address, "error": _why(exc)})
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)


class ModelCatalog:
    """Models the gateway accepts: the registry's, plus any an engine serves (the
    sim backend's, say). Refreshed in the background, never on the request path."""

    def __init__(self, resolve: Resolver | None, picker: EndpointPicker, refresh_s: float = 10.0):
        self._resolve = resolve
        self._picker = picker
        self._refresh = refresh_s
        self._registry: set[str] = set()

    def known(self, model: str) -> bool:
        return model in self._registry or model in self._picker.seen_models()

    def names(self) -> list[str]:
        return sorted(self._registry | self._picker.models())

    async def run(self) -> None:
        if self._resolve is None:
            return
        while True:
            try:
                async with insecure_channel(await self._resolve()) as channel:
                    resp = await modelmgr_pb2_grpc.ModelManagerStub(channel).ListModels(
                        modelmgr_pb2.ListModelsRequest(), timeout=10)
                self._registry = {m.name for m in resp.models}
            except (grpc.aio.AioRpcError, DiscoveryError) as exc:
                log.warning("model registry unreachable; keeping the last catalog", extra={"error": _why(exc)})
            await asyncio.sleep(self._refresh)

"""Gateway composition root: picker, upstream adapters, pipeline, HTTP and gRPC fronts."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import redis.asyncio
import redis.exceptions
import uvicorn
from prometheus_client import CollectorRegistry

from llmesh.audit import AuditLog
from llmesh.background import cancel_all
from llmesh.keys import FileKeyStore, KeyStore, RedisKeyStore
from llmesh.liveconfig.schema import MeshConfig
from llmesh.platform import Platform, standalone_platform
from llmesh.rpc.server import GrpcServer, ServiceBinding
from llmesh.shadow import FileShadowStore, RedisShadowStore
from llmesh.ports import bind_retrying, listen_socket
from llmesh.settings import MeshSettings
from llmesh.v1 import gateway_pb2_grpc
from llmesh.discovery.base import Registry
from llmesh.errors import DiscoveryError
from llmesh.service import StartFailed
from llmesh.gateway.config import GatewaySettings
from llmesh.gateway.domain.auth_mode import AuthMode, auth_mode, shared_store_problem
from llmesh.gateway.domain.limits import FallbackLimiter, Limiter, LocalLimiter
from llmesh.gateway.domain.limits_redis import RedisLimiter
from llmesh.gateway.domain.prompt_tokens import PromptTokens
from llmesh.gateway.domain.holds import Holds
from llmesh.gateway.domain.tokens import TokenCounter
from llmesh.gateway.domain.batches.kv import DirKv, Kv
from llmesh.gateway.domain.batches.kv_redis import RedisKv
from llmesh.gateway.domain.batches.queue import LocalQueue, WorkQueue
from llmesh.gateway.domain.batches.queue_redis import StreamQueue
from llmesh.gateway.domain.batches.runner import BatchRunner, RunnerSettings
from llmesh.gateway.domain.batches.service import BatchLimits, BatchService
from llmesh.gateway.domain.batches.store import BatchStore
from llmesh.gateway.fronts.batches import BatchFront
from llmesh.gateway.fronts.body import BodyReader
from llmesh.gateway.fronts.http import HttpFront
from llmesh.gateway.fronts.servicer import GatewayServicer
from llmesh.gateway.guard_workers import GuardWorkers
from llmesh.gateway.loop_watch import watch_loop
from llmesh.gateway.metrics import DegradeMetrics, FlowMetrics, GatewayMetrics, LedgerMetrics
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.stages.audit import AuditStage
from llmesh.gateway.stages.auth import AuthenticateStage, Authenticator, JwtSettings, JwtVerifier
from llmesh.gateway.stages.base import Stage
from llmesh.gateway.stages.cache import CacheStage
from llmesh.gateway.stages.cascade import CascadeMetrics, CascadeStage
from llmesh.gateway.stages.coldstart import ColdStartStage
from llmesh.gateway.stages.context_length import ContextLengthStage
from llmesh.gateway.stages.degrade import DegradeStage
from llmesh.gateway.stages.flow import FlowController, FlowStage
from llmesh.gateway.stages.flow_shared import SharedFlowController
from llmesh.gateway.stages.grants import AuthorizeStage, access
from llmesh.gateway.stages.guards import GuardStage
from llmesh.gateway.stages.limits import LimitStage
from llmesh.gateway.stages.route import RouteStage
from llmesh.gateway.stages.shadow import ShadowMetrics, ShadowStage
from llmesh.gateway.stages.validate import ValidateStage
from llmesh.gateway.upstream.cache import CacheClient
from llmesh.gateway.upstream.catalog import ModelCatalog, ScaledCatalog
from llmesh.gateway.domain.listing import ListedModel, listed_models
from llmesh.gateway.upstream.demand import DemandReporter
from llmesh.gateway.upstream.engines import EngineClients
from llmesh.gateway.upstream.feed import SchedulerFeed
from llmesh.gateway.upstream.ledger_share import LedgerShare
from llmesh.gateway.upstream.picking import EndpointPicker, PickInput
from llmesh.gateway.upstream.provider_secrets import ProviderSecrets
from llmesh.gateway.upstream.providers import ProviderClients
from llmesh.gateway.upstream.resilience import Breakers, RetryBudgetGate

log = logging.getLogger("llmesh.gateway")


STORE_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)  # a store that cannot answer


def _redis(url: str) -> redis.asyncio.Redis:
    # Timeouts count time the event loop spends elsewhere too, so they are generous: a refused
    # connection falls back at once; a busy Redis or gateway gets 10 s. A burst queues for one of
    # 32 connections (opened once, kept) rather than opening hundreds at the same moment.
    return redis.asyncio.Redis(connection_pool=redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=32, timeout=10.0, socket_timeout=10.0, socket_connect_timeout=2.0))


def _jwt_verifier(settings: GatewaySettings) -> JwtVerifier | None:
    if not (settings.jwks_file or settings.jwks_url):
        return None
    return JwtVerifier(JwtSettings(
        jwks_file=settings.jwks_file, jwks_url=settings.jwks_url, issuer=settings.jwt_issuer,
        audience=settings.jwt_audience, tenant_claim=settings.jwt_tenant_claim,
        groups_claim=settings.jwt_groups_claim, refetch_s=settings.jwks_refetch_s))


def _auth_mode(settings: GatewaySettings, redis_url: str | None) -> AuthMode:
    return auth_mode(http_host=settings.http_host, grpc_host=settings.host, redis=bool(redis_url),
                     jwt=bool(settings.jwks_file or settings.jwks_url), require_auth=settings.require_auth)


async def _check_shared_store(registry: Registry, redis: bool) -> None:
    """Refuse to start beside another registered gateway when the API keys are in a store
    of this process's own (llmesh.gateway.domain.auth_mode.shared_store_problem)."""
    if redis:
        return
    try:
        others = await asyncio.wait_for(registry.resolve("gateway"), 10)
    except (DiscoveryError, asyncio.TimeoutError) as exc:
        log.warning("cannot tell whether other gateway replicas run; starting", extra={"error": str(exc)})
        return
    problem = shared_store_problem(len(others), redis)
    if problem:
        raise StartFailed(problem)


def _provider_secrets(settings: GatewaySettings, mesh: MeshSettings) -> ProviderSecrets:
    """The key sources providers may use; never a directory holding the mesh's own files
    (every ``*_file`` setting but the config: certificates, keys, the service secret)."""
    mesh_files = [value for name, value in mesh if name.endswith("_file") and name != "config_file"
                  and isinstance(value, Path)]
    return ProviderSecrets.of(settings.provider_key_dir or mesh.state_dir / "provider-keys",
                              filter(None, settings.provider_key_envs.split(",")), mesh_files)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our own loop: the process's signal handling stays ours."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayApp:
    def __init__(self, settings: GatewaySettings, platform: Platform | None = None):
        self.settings = settings
        platform = platform or standalone_platform("gateway")
        self._platform = platform
        self.config = platform.config
        self.picker = EndpointPicker()
        tracer = platform.tracing.tracer
        identity = platform.identity
        self.engines = EngineClients(tracer, identity)
        self.providers = ProviderClients(secrets=_provider_secrets(settings, platform.settings))
        platform.config.add_check(self.providers.secrets.check)  # a config naming other secrets is refused
        self.cache = (CacheClient(platform.resolver("cache", settings.cache_address), settings.cache_budget_s,
                                  tracer=tracer, config=self._current, identity=identity)
                      if settings.cache_address else None)
        self.model_catalog = ModelCatalog(platform.resolver("modelmgr", settings.modelmgr_address)
                                         if settings.modelmgr_address else None,
                                         self.picker, settings.catalog_refresh_s, identity)
        self.catalog = ScaledCatalog(self.model_catalog, self._current)
        scheduler = platform.resolver("scheduler", settings.scheduler_address)
        self.feed = SchedulerFeed(scheduler, self.picker, identity)
        self.holds = Holds()
        self.demand = DemandReporter(scheduler, self.holds, f"{socket.gethostname()}:{os.getpid()}",
                                     identity)
        self.metrics = GatewayMetrics(platform.metrics, known=self._known_model)
        mesh = platform.settings
        self.redis = _redis(mesh.redis_url) if mesh.redis_url else None
        self.ledger = self._ledger_share(settings, mesh.redis_url, platform.metrics)
        self._authentication(settings, mesh)
        self.prompt_tokens = prompt_tokens = PromptTokens(settings.model_dir)  # one tokenizer a model: limits, picks
        self.audit = (AuditLog(settings.audit_file or mesh.state_dir / "audit.jsonl", fsync=settings.audit_fsync,
                               on_lost=self.metrics.audit_failures.inc)
                      if settings.audit else None)
        self.guard_workers = (GuardWorkers(settings.guard_workers, settings.guard_deadline_s, settings.guard_queue)
                              if settings.guard_workers else None)
        shadow_store = (RedisShadowStore(self.redis) if self.redis is not None
                        else FileShadowStore(mesh.state_dir / "shadow"))
        self.shadow = ShadowStage(self._current, shadow_store, ShadowMetrics(platform.metrics))
        breakers = Breakers(lambda: self.config.current.circuit_breaker,
                            on_state=lambda endpoint, state: self.metrics.breaker.labels(endpoint).set(int(state)))
        self.pipeline = Pipeline(self.picker, self.engines, self.catalog, observe=self.metrics.observe, tracer=tracer,
                                 stages=self._stages(platform, prompt_tokens), prompt_tokens=prompt_tokens,
                                 breakers=breakers, budget=RetryBudgetGate(lambda: self.config.current.retry_budget),
                                 providers=self.providers, config=self._current,
                                 retry_after_s=settings.queue_full_retry_after_s,
                                 lost_engine_hold_s=settings.lost_engine_hold_s)
        self._draining = False
        self.batches = self._batch_service(settings, mesh)
        self.http = self._http_front(settings)
        servicer = GatewayServicer(self.pipeline, self.models_for, settings.request_timeout_s,
                                   (self.batches, self.authenticator.authenticate))
        self.grpc = GrpcServer(settings.address, [ServiceBinding(
            "llmesh.v1.Gateway", servicer, gateway_pb2_grpc.add_GatewayServicer_to_server,
            unparsed=servicer.unparsed)], tracer=platform.tracing.tracer,
            reuse_port=settings.workers > 1,  # worker processes share the ports (llmesh.workers)
            bind_wait_s=settings.bind_wait_s, serving=platform.serving)
        self._uvicorn = _EmbeddedUvicorn(uvicorn.Config(
            self.http.app, host=settings.http_host, port=settings.http_port, log_config=None,
            access_log=False, lifespan="off", http="httptools", loop="none", interface="asgi3",
            proxy_headers=False, timeout_graceful_shutdown=int(settings.grace_s) or 1))
        self._tasks: list[asyncio.Task] = []

    def _ledger_share(self, settings: GatewaySettings, redis_url: str | None,
                      registry: CollectorRegistry) -> LedgerShare | None:
        """With a Redis: the picker's in-flight load shared with the other gateway processes, on a
        client of its own (a round never waits for the request path's connections); a drop in the
        peers' work in flight tells flow control, as a new endpoint table does."""
        if not redis_url or not settings.ledger_share_s:
            return None
        self._ledger_redis = redis.asyncio.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        share = LedgerShare(self._ledger_redis, self.picker.local, settings.ledger_share_s,
                            on_drop=lambda: self.flow.poke(), on_round=LedgerMetrics(registry).round)
        self.picker.on_ledger.append(share.changed)
        return share

    def _authentication(self, settings: GatewaySettings, mesh: MeshSettings) -> None:
        """The key store and the authenticator; local mode is decided here, from settings only."""
        self.keys: KeyStore = (RedisKeyStore(self.redis) if self.redis is not None
                               else FileKeyStore(settings.keys_file or mesh.state_dir / "keys.json"))
        self.auth_mode = _auth_mode(settings, mesh.redis_url)
        self.authenticator = Authenticator(self.keys, _jwt_verifier(settings), local=self.auth_mode.local,
                                           store_errors=STORE_ERRORS,
                                           on_size=lambda kind, n: self.metrics.auth_cache.labels(kind).set(n))

    def _http_front(self, settings: GatewaySettings) -> HttpFront:
        bodies = BodyReader(self.guard_workers.call if self.guard_workers else None, settings.body_offload_bytes,
                            settings.guard_workers)  # a large body parsed off the event loop
        batch_front = BatchFront(self.batches, self.authenticator.authenticate, settings.body_timeout_s)
        return HttpFront(self.pipeline, self.models_for, lambda: not self._draining, settings.request_timeout_s,
                         settings.body_timeout_s, bodies, batch_front)

    def _batch_service(self, settings: GatewaySettings, mesh: MeshSettings) -> BatchService:
        """The Batch API's store and queue: Redis (a stream with a consumer group, shared by every
        gateway worker) when there is one, else a directory and an in-process queue."""
        kv: Kv
        if self.redis is not None:
            kv = RedisKv(self.redis, settings.batch_retention_s)
            self._batch_queue: WorkQueue = StreamQueue(self.redis, settings.batch_claim_idle_s)
        else:
            kv = DirKv(settings.batch_dir or mesh.state_dir / "batches")
            self._batch_queue = LocalQueue()
        store = BatchStore(kv)
        # each line through the HTTP front's own parsing, pipeline and encoding (built after this)
        self.batch_runner = BatchRunner(store, self._batch_queue, lambda *line: self.http.run_line(*line),
                                        lambda: self.picker.low_room(settings.batch_headroom, settings.batch_in_flight),
                                        RunnerSettings(settings.batch_in_flight, settings.batch_busy_in_flight,
                                                       stale_finalizing_s=settings.batch_claim_idle_s / 2))
        self._batch_task: asyncio.Task[None] | None = None
        return BatchService(store, self._batch_queue, BatchLimits(
            settings.batch_max_file_bytes, settings.batch_max_lines, settings.batch_max_files))

    def _current(self) -> MeshConfig:
        return self.config.current

    def _stages(self, platform: Platform, prompt_tokens: PromptTokens) -> list[Stage]:
        """The request path, in order. The audit stage is first, so its finish runs last and
        sees every other stage's annotations; the cache looks up the request as the engines
        would see it (after the guards); the shadow's wrap is the outermost, so it sees the
        answer the client gets."""
        settings, current = self.settings, self._current
        local = LocalLimiter()
        limiter: Limiter = local
        if self.redis is not None:
            limiter = FallbackLimiter(RedisLimiter(self.redis), local, errors=STORE_ERRORS, retry_s=5.0,
                                      on_fallback=self.metrics.limits_fallback.inc)
        audit = (AuditStage(self.audit, settings.audit_required, self.metrics.audit_failures.inc)
                 if self.audit else None)
        self.flow = self._flow_control(settings, platform)
        return [*([audit] if audit else []),
                AuthenticateStage(self.authenticator), ValidateStage(), AuthorizeStage(current),
                CascadeStage(current, CascadeMetrics(platform.metrics)),  # a cascade alias -> its cheap model
                RouteStage(self.catalog, current),
                # under load: capped max_tokens, a smaller variant or a looser cache match, seen by the stages after
                DegradeStage(current, self.flow.load, self.catalog, DegradeMetrics(platform.metrics)),
                # before anything that scales with the prompt (token counting, guards, cache key)
                ContextLengthStage(self.picker.context_length, prompt_tokens.floor, current),
                LimitStage(limiter, current, TokenCounter(prompt_tokens), settings.reserve_tokens,
                           lease_s=settings.request_timeout_s),
                GuardStage(current, offload=self.guard_workers.run if self.guard_workers else None,
                           max_chars=settings.injection_scan_chars,
                           max_total_chars=settings.injection_scan_total_chars),
                ColdStartStage(self._ready, self.holds, current),
                FlowStage(self.flow, current),  # its wrap inside the cache's: a hit never waits
                *([CacheStage(self.cache, current)] if self.cache else []),
                self.shadow]

    def _ready(self, model: str) -> bool:
        """Some replica could take a request for ``model`` now."""
        now = time.monotonic()  # a generative replica, or an embedding one
        return bool(self.picker.candidates(PickInput(model=model, now=now))
                    or self.picker.candidates(PickInput(model=model, now=now, embed=True)))

    def _flow_control(self, settings: GatewaySettings, platform: Platform) -> FlowController | SharedFlowController:
        """Flow control's queues, told of every new endpoint table (capacity may have freed): with
        a Redis, one fair order per model shared by every worker and replica (this worker's own
        queues while Redis does not answer)."""
        metrics = FlowMetrics(platform.metrics)
        local = FlowController(self._current, self._capacity, settings.queue_full_retry_after_s, metrics=metrics)
        flow: FlowController | SharedFlowController = local
        if self.redis is not None:
            flow = SharedFlowController(self.redis, local, self._current, self._capacity, metrics,
                                        errors=STORE_ERRORS, on_fallback=self.metrics.flow_fallback.inc)
        self.picker.on_table.append(flow.poke)
        return flow

    def _capacity(self, model: str, embed: bool, engine_queue: int) -> tuple[int, int, int]:
        """The model's endpoints' slots for flow control: (free, in all, ours in flight)."""
        return self.picker.capacity(PickInput(model=model, now=time.monotonic(), embed=embed), engine_queue)

    def _known_model(self, model: str) -> bool:
        """A name the gateway knows (catalog, splits, cascades, providers): the only model
        names that become metric labels."""
        config = self.config.current
        return (model in config.splits or model in config.cascades or self.catalog.known(model)
                or config.provider_for(model) is not None)

    def model_names(self) -> list[ListedModel]:
        """What a request can be answered for now (domain/listing.py): healthy engines' models,
        provider-mapped and autoscaled models, and the aliases and fallbacks over them."""
        return listed_models(self.config.current, self.picker.healthy_models(), self.picker.embedding_models())

    async def models_for(self, credential: str | None) -> list[ListedModel]:
        """The listed models this credential's tenant may use (401 for bad credentials)."""
        grant = access(self.config.current, await self.authenticator.authenticate(credential))
        return [m for m in self.model_names() if grant.allows(m.name)]

    @property
    def advertise_address(self) -> str:
        return self.grpc.bound_address

    @property
    def health_service(self) -> str:
        return "llmesh.v1.Gateway"

    async def start(self) -> None:
        if self._platform.settings.discovery != "static":
            await _check_shared_store(self._platform.registry, self.redis is not None)
        log.info("gateway authentication", extra={"local_mode": self.auth_mode.local,
                                                   "why": self.auth_mode.describe()})
        self._tasks = [asyncio.create_task(self.feed.run(), name="scheduler-feed"),
                       asyncio.create_task(self.model_catalog.run(), name="model-catalog"),
                       asyncio.create_task(self.demand.run(), name="demand-reporter"),
                       asyncio.create_task(self.flow.run(), name="flow-control")]
        if self.ledger is not None:
            self._tasks.append(asyncio.create_task(self.ledger.run(), name="ledger-share"))
        if self.settings.loop_watch_ms:
            self._tasks.append(asyncio.create_task(watch_loop(self.settings.loop_watch_ms / 1000), name="loop-watch"))
        if self.guard_workers is not None:
            await self.guard_workers.start()
        await self.grpc.start()
        host, port = self.settings.http_host, self.settings.http_port
        sock = await bind_retrying(lambda: listen_socket(host, port, reuse_port=self.settings.workers > 1),
                                   f"{host}:{port}", wait_s=self.settings.bind_wait_s)
        self._tasks.append(asyncio.create_task(self._uvicorn.serve([sock]), name="http"))
        while not self._uvicorn.started:
            if self._tasks[-1].done():
                self._tasks[-1].result()  # re-raise the bind error
                raise OSError(f"HTTP server did not start on {self.settings.http_host}:{self.settings.http_port}")
            await asyncio.sleep(0.01)
        if self.redis is None:
            await self.batches.resume()  # the in-process queue began empty: open batches' lines again
        self._batch_task = asyncio.create_task(self.batch_runner.run(), name="batch-runner")
        # What start-up built (protos, models, settings, clients) lives as long as the process: the cyclic
        # collector stops walking it on every full collection (~20 us of a request's CPU).
        gc.collect()
        gc.freeze()
        log.info("gateway ready", extra={"http": f"{self.settings.http_host}:{self.settings.http_port}",
                                         "grpc": self.grpc.bound_address})

    async def stop(self, grace: float) -> None:
        self._draining = True
        self._uvicorn.should_exit = True  # stops accepting; in-flight responses finish
        if self._batch_task is not None:
            self._batch_task.cancel()  # no new lines; those in flight get the grace
        await asyncio.gather(self.grpc.stop(grace), self._tasks[-1], self.batch_runner.stop(grace),
                             return_exceptions=True)
        await cancel_all(self._tasks[:-1])
        await self.pipeline.drain()  # the stages' finishes and the cache's stores
        await self.shadow.close()  # shadow copies in flight
        await self.engines.close()
        await self.providers.close()
        if self.cache:
            await self.cache.close()
        if self.ledger is not None:
            await self.ledger.leave()
            await self._ledger_redis.aclose()
        if self.redis is not None:
            await self.redis.aclose()
        if self.audit is not None:
            await asyncio.to_thread(self.audit.close)
        if self.guard_workers is not None:
            self.guard_workers.close()
        self.prompt_tokens.close()

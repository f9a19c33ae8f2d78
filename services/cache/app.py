"""Cache composition root: store (in-process or Redis) behind a fail-open guard,
the semantic index (MiniLM + per-scope nearest neighbours), live config, gRPC."""

from __future__ import annotations

import asyncio
import logging

from threadpoolctl import threadpool_limits

from llmesh.background import cancel_all
from llmesh.backoff import Backoff
from llmesh.platform import Platform, standalone_platform
from llmesh.rpc.server import GrpcServer, ServiceBinding
from llmesh.v1 import cache_pb2_grpc

from llmesh.liveconfig.schema import CacheEmbedder
from llmesh.cache.config import CacheSettings
from llmesh.cache.embedders import EmbedderSecrets, Embedders, build_embedder
from llmesh.cache.failopen import FailOpen
from llmesh.cache.memory import MemoryStore
from llmesh.cache.metrics import CacheMetrics
from llmesh.cache.responses import ResponseCache
from llmesh.cache.semantic import Embedder, SemanticIndex
from llmesh.cache.servicer import CacheServicer
from llmesh.cache.store import Store
from llmesh.cache.verifier import HttpJudge

log = logging.getLogger("llmesh.cache")


def build_store(settings: CacheSettings) -> Store:
    if settings.backend == "redis":
        from llmesh.cache.redis_store import RedisStore
        return RedisStore(settings.redis_url, settings.max_entries_per_tenant, settings.store_budget_s,
                          settings.namespace)
    return MemoryStore(settings.max_entries_per_tenant)


# Lookups embed side by side on worker threads, each on one BLAS thread. With OpenBLAS's own threads
# (one per core) a lookup's embedding took 41-47 ms p50 and 138-377 ms p99 while two busy processes
# shared the 2 cores (engines on the cache's machine), against 26 ms and 36-38 ms on one thread; idle,
# 9 against 13 ms p50 and 20.5 against 16.5 ms p99 (272 semantic lookups over gRPC, real MiniLM).
EMBED_BLAS_THREADS = 1


def build_semantic(settings: CacheSettings, metrics: CacheMetrics, secrets: EmbedderSecrets
                   ) -> tuple[SemanticIndex, Embedders]:
    """The index, and the embedders the live config chooses from: the default one (MiniLM in
    ``embed_model_dir``) is loaded now, if it is there; another is built when first chosen. BLAS
    runs on ``EMBED_BLAS_THREADS`` in this process from now on."""
    threadpool_limits(EMBED_BLAS_THREADS, user_api="blas")
    built: dict[CacheEmbedder, Embedder] = {}
    if (settings.embed_model_dir / "model.safetensors").is_file():
        built[CacheEmbedder()] = build_embedder(CacheEmbedder(), settings.embed_model_dir, secrets)
    else:
        log.warning("no embedding model; semantic mode matches exactly until another embedder is configured",
                    extra={"model_dir": str(settings.embed_model_dir)})
    embedders = Embedders(lambda spec: build_embedder(spec, settings.embed_model_dir, secrets), built)
    index = SemanticIndex(next(iter(built.values()), None), hnsw_min=settings.hnsw_min,
                          on_refusal=lambda guard: _refused(metrics, guard))
    return index, embedders


def _refused(metrics: CacheMetrics, guard: str) -> None:
    metrics.guard_refusals.labels(guard).inc()
    metrics.verdicts.labels("guards", "refused").inc()


class CacheApp:
    def __init__(self, settings: CacheSettings, platform: Platform | None = None):
        platform = platform or standalone_platform("cache")
        live = platform.config
        self.metrics = CacheMetrics(platform.metrics)
        self.store = build_store(settings)
        self.guarded = FailOpen(self.store, settings.store_budget_s, settings.store_pause_s,
                                on_error=lambda op: self.metrics.store_errors.labels(op).inc())
        secrets = EmbedderSecrets(settings.embed_key_dir,
                                  frozenset(n for n in settings.embed_key_envs.split(",") if n))
        self.semantic, self.embedders = build_semantic(settings, self.metrics, secrets)
        self.judge = HttpJudge(secrets)
        self.cache = ResponseCache(self.guarded, self.semantic, lambda: live.current.cache,
                                   on_lookup=lambda outcome: self.metrics.lookups.labels(outcome).inc(),
                                   on_late=lambda outcome: self.metrics.late_lookups.labels(outcome).inc(),
                                   embedder=lambda cache: self.embedders(cache.embedder),
                                   on_embed_error=lambda error: self.metrics.embed_errors.labels(error).inc(),
                                   judge=self.judge,
                                   on_verdict=lambda stage, verdict: self.metrics.verdicts.labels(stage, verdict).inc())
        self.server = GrpcServer(settings.address, [ServiceBinding(
            "llmesh.v1.Cache",
            CacheServicer(self.cache, self.metrics, self.store.backend, lambda: self.guarded.available),
            cache_pb2_grpc.add_CacheServicer_to_server)],
            tracer=platform.tracing.tracer, identity=platform.identity, bind_wait_s=settings.bind_wait_s,
            serving=platform.serving)
        self._tasks: list[asyncio.Task] = []

    @property
    def advertise_address(self) -> str:
        return self.server.bound_address

    @property
    def health_service(self) -> str:
        return "llmesh.v1.Cache"

    async def start(self) -> None:
        await self.server.start()
        self._tasks = [asyncio.create_task(self._follow(), name="semantic-follow"),
                       asyncio.create_task(self._sweep(), name="semantic-sweep")]

    def _rebuilt(self, n: int) -> None:
        self.metrics.indexed.set(self.cache.semantic_indexed)
        log.info("semantic index rebuilt", extra={"entries": n, "backend": self.store.backend})

    async def _follow(self) -> None:
        """Index what the store holds and what any replica stores from now on; if the
        store goes away, listen and rebuild again when it is back (lookups meanwhile
        bypass it, and entries stored elsewhere in between are not missed)."""
        backoff = Backoff(initial_s=0.5, max_s=10.0)
        while True:
            try:
                await self.cache.follow(self._rebuilt)
                return
            except Exception as exc:  # noqa: BLE001 - the store is away; try again
                wait = backoff.next()
                log.warning("cannot follow the store's semantic entries; retrying",
                            extra={"error": type(exc).__name__, "retry_in_s": wait})
            await asyncio.sleep(wait)

    async def _sweep(self, every_s: float = 30.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            if self.semantic is not None:
                self.semantic.sweep()
                self.metrics.indexed.set(self.cache.semantic_indexed)

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)
        await cancel_all(self._tasks)
        await self.cache.drain()
        await self.embedders.close()
        await self.judge.close()
        await self.store.close()



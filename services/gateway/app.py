"""Gateway composition root: picker, upstream adapters, pipeline, HTTP and gRPC fronts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from llmesh.platform import Platform, standalone_platform
from llmesh.rpc.server import GrpcServer, ServiceBinding
from llmesh.v1 import gateway_pb2_grpc
from llmesh.gateway.config import GatewaySettings
from llmesh.gateway.endpoints import EndpointPicker
from llmesh.gateway.http import HttpFront
from llmesh.gateway.metrics import GatewayMetrics
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.servicer import GatewayServicer
from llmesh.gateway.upstreams import CacheClient, EngineClients, ModelCatalog, SchedulerFeed

log = logging.getLogger("llmesh.gateway")


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our own loop: the process's signal handling stays ours."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayApp:
    def __init__(self, settings: GatewaySettings, platform: Platform | None = None):
        self.settings = settings
        platform = platform or standalone_platform("gateway")
        self.config = platform.config
        self.picker = EndpointPicker()
        tracer = platform.tracing.tracer
        self.engines = EngineClients(tracer)
        self.cache = (CacheClient(platform.resolver("cache", settings.cache_address), settings.cache_budget_s,
                                  tracer=tracer)
                      if settings.cache_address else None)
        self.catalog = ModelCatalog(platform.resolver("modelmgr", settings.modelmgr_address)
                                    if settings.modelmgr_address else None,
                                    self.picker, settings.catalog_refresh_s)
        self.feed = SchedulerFeed(platform.resolver("scheduler", settings.scheduler_address), self.picker)
        self.metrics = GatewayMetrics(platform.metrics)
        self.pipeline = Pipeline(self.picker, self.engines, self.catalog, self.cache,
                                 config=lambda: self.config.current, observe=self.metrics.observe, tracer=tracer)
        self._draining = False
        self.http = HttpFront(self.pipeline, self.model_names, lambda: not self._draining,
                              settings.request_timeout_s)
        self.grpc = GrpcServer(settings.address, [ServiceBinding(
            "llmesh.v1.Gateway", GatewayServicer(self.pipeline, self.model_names, settings.request_timeout_s),
            gateway_pb2_grpc.add_GatewayServicer_to_server)], tracer=platform.tracing.tracer)
        self._uvicorn = _EmbeddedUvicorn(uvicorn.Config(
            self.http.app, host=settings.http_host, port=settings.http_port, log_config=None,
            access_log=False, lifespan="off", http="httptools", loop="none", interface="asgi3",
            proxy_headers=False,
            timeout_graceful_shutdown=int(settings.grace_s) or 1))
        self._tasks: list[asyncio.Task] = []

    def model_names(self) -> list[str]:
        """What clients may ask for: registered and served models, and split aliases."""
        return sorted(set(self.catalog.names()) | set(self.config.current.splits))

    @property
    def advertise_address(self) -> str:
        return self.grpc.bound_address

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self.feed.run(), name="scheduler-feed"),
                       asyncio.create_task(self.catalog.run(), name="model-catalog")]
        await self.grpc.start()
        self._tasks.append(asyncio.create_task(self._uvicorn.serve(), name="http"))
        while not self._uvicorn.started:
            if self._tasks[-1].done():
                self._tasks[-1].result()  # re-raise the bind error
                raise OSError(f"HTTP server did not start on {self.settings.http_host}:{self.settings.http_port}")
            await asyncio.sleep(0.01)
        log.info("gateway ready", extra={"http": f"{self.settings.http_host}:{self.settings.http_port}",
                                         "grpc": self.grpc.bound_address})

    async def stop(self, grace: float) -> None:
        self._draining = True
        self._uvicorn.should_exit = True  # stops accepting; in-flight responses finish
        await asyncio.gather(self.grpc.stop(grace), self._tasks[-1], return_exceptions=True)
        for task in self._tasks[:-1]:
            task.cancel()
        await asyncio.gather(*self._tasks[:-1], return_exceptions=True)
        await self.pipeline.drain()
        await self.engines.close()
        if self.cache:
            await self.cache.close()

"""Cache composition root."""

from __future__ import annotations

from llmesh.platform import Platform
from llmesh.rpc.server import GrpcServer, ServiceBinding
from llmesh.v1 import cache_pb2_grpc
from prometheus_client import CollectorRegistry

from llmesh.cache.config import CacheSettings
from llmesh.cache.metrics import CacheMetrics
from llmesh.cache.memory import LruTtlStore
from llmesh.cache.servicer import CacheServicer


class CacheApp:
    def __init__(self, settings: CacheSettings, platform: Platform | None = None):
        self.store: LruTtlStore[bytes] = LruTtlStore(settings.max_entries, settings.ttl_s)
        self.server = GrpcServer(settings.address, [ServiceBinding(
            "llmesh.v1.Cache", CacheServicer(self.store, CacheMetrics(platform.metrics if platform else CollectorRegistry())),
            cache_pb2_grpc.add_CacheServicer_to_server)],
            tracer=platform.tracing.tracer if platform else None,
            identity=platform.identity if platform else None)

    @property
    def advertise_address(self) -> str:
        return self.server.bound_address

    @property
    def health_service(self) -> str:
        return "llmesh.v1.Cache"

    async def start(self) -> None:
        await self.server.start()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)

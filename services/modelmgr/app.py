"""Model manager composition root."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Gauge

from llmesh.modelstore import ModelStore
from llmesh.platform import Platform
from llmesh.rpc.server import GrpcServer, ServiceBinding
from llmesh.v1 import modelmgr_pb2_grpc
from llmesh.modelmgr.config import ModelMgrSettings
from llmesh.modelmgr.servicer import ModelManagerServicer


class ModelMgrApp:
    def __init__(self, settings: ModelMgrSettings, platform: Platform | None = None):
        self.store = ModelStore(settings.model_dir)
        self._models = Gauge("llmesh_models", "Models in the store by format.", ("format",),
                             registry=platform.metrics if platform else CollectorRegistry())
        self.server = GrpcServer(settings.address, [ServiceBinding(
            "llmesh.v1.ModelManager", ModelManagerServicer(self.store),
            modelmgr_pb2_grpc.add_ModelManagerServicer_to_server)],
            tracer=platform.tracing.tracer if platform else None)

    @property
    def advertise_address(self) -> str:
        return self.server.bound_address

    @property
    def health_service(self) -> str:
        return "llmesh.v1.ModelManager"

    async def start(self) -> None:
        records = await asyncio.to_thread(self.store.list)  # checksums computed before we say SERVING
        for fmt in {r.format for r in records}:
            self._models.labels(fmt).set(sum(r.format == fmt for r in records))
        await self.server.start()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)

"""Model manager composition root."""

from __future__ import annotations

import asyncio

from llmesh.modelstore import ModelStore
from llmesh.platform import Platform
from llmesh.rpc.server import GrpcServer, ServiceBinding
from llmesh.v1 import modelmgr_pb2_grpc
from llmesh.modelmgr.config import ModelMgrSettings
from llmesh.modelmgr.servicer import ModelManagerServicer


class ModelMgrApp:
    def __init__(self, settings: ModelMgrSettings, platform: Platform | None = None):
        self.store = ModelStore(settings.model_dir)
        self.server = GrpcServer(settings.address, [ServiceBinding(
            "llmesh.v1.ModelManager", ModelManagerServicer(self.store),
            modelmgr_pb2_grpc.add_ModelManagerServicer_to_server)])

    @property
    def advertise_address(self) -> str:
        return self.server.bound_address

    async def start(self) -> None:
        await asyncio.to_thread(self.store.list)  # checksums computed before we say SERVING
        await self.server.start()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)

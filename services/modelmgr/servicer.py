"""Model manager gRPC servicer: protobuf <-> model store."""

from __future__ import annotations

import asyncio

from llmesh.errors import ModelNotFound
from llmesh.modelstore import ModelRecord, ModelStore
from llmesh.v1 import common_pb2, modelmgr_pb2, modelmgr_pb2_grpc


def record_pb(r: ModelRecord) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(name=r.name, format=r.format, size_bytes=r.size_bytes, sha256=r.sha256,
                                context_length=r.context_length, path=str(r.path), source=r.source)


class ModelManagerServicer(modelmgr_pb2_grpc.ModelManagerServicer):
    def __init__(self, store: ModelStore):
        self._store = store

    async def ListModels(self, request, context):
        # Hashing a new artifact reads the whole file: keep it off the event loop.
        records = await asyncio.to_thread(self._store.list)
        return modelmgr_pb2.ListModelsResponse(models=[record_pb(r) for r in records])

    async def GetModel(self, request, context):
        record = await asyncio.to_thread(self._store.get, request.name)
        if record is None:
            raise ModelNotFound(request.name)
        return record_pb(record)

"""The fetcher's ArtifactSource over gRPC: the model manager's GetArtifactManifest and
FetchArtifact, as this engine's mesh identity (only engines may call them)."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import grpc

from llmesh.discovery.base import Resolver
from llmesh.errors import Unavailable
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import Identity
from llmesh.rpc.status import from_rpc_error
from llmesh.v1 import modelmgr_pb2, modelmgr_pb2_grpc
from llmesh.engine.fetcher import RemoteFile, RemoteManifest


class GrpcArtifactSource:
    def __init__(self, resolve: Resolver, identity: Identity | None = None, call_timeout_s: float = 30.0):
        self._resolve = resolve
        self._identity = identity
        self._timeout = call_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._address = ""

    async def _stub(self) -> modelmgr_pb2_grpc.ModelManagerStub:
        try:
            address = await self._resolve()
        except LookupError as exc:
            raise Unavailable(f"the model manager is not registered ({exc})") from None
        if self._channel is None or address != self._address:
            if self._channel is not None:
                await self._channel.close()
            self._channel, self._address = mesh_channel(address, "modelmgr", self._identity), address
        return modelmgr_pb2_grpc.ModelManagerStub(self._channel)

    async def manifest(self, name: str) -> RemoteManifest:
        stub = await self._stub()
        try:
            m = await stub.GetArtifactManifest(modelmgr_pb2.GetArtifactManifestRequest(served_name=name),
                                               timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return RemoteManifest(m.served_name, tuple(RemoteFile(f.path, f.sha256, f.size_bytes) for f in m.files),
                              m.metadata_json)

    async def chunks(self, sha256: str, offset: int) -> AsyncGenerator[tuple[int, bytes, int], None]:
        # No deadline on the stream as a whole (a large model takes its time): the fetcher
        # cuts a stream that goes quiet and bounds the fetch.
        call = (await self._stub()).FetchArtifact(modelmgr_pb2.FetchArtifactRequest(sha256=sha256, offset=offset))
        try:
            async for chunk in call:
                yield chunk.offset, chunk.data, chunk.size_bytes
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

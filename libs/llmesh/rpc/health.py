"""Client side of grpc.health.v1, for supervisors and status tools."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import Identity


async def health_status(address: str, service: str = "", timeout_s: float = 1.0,
                        identity: Identity | None = None, target_service: str = "") -> str:
    """SERVING, NOT_SERVING, ... or UNREACHABLE. In "tls" trust the check needs ``identity``
    and the ``target_service`` it expects at ``address`` (the handshake asks for both)."""
    async with mesh_channel(address, target_service, identity) as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return "UNREACHABLE"
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return name

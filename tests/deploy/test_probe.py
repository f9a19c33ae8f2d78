"""`python -m llmesh.rpc.probe`, the health check of every image and compose service,
against a real gRPC server with grpc.health.v1."""

from __future__ import annotations

import asyncio
import sys

from llmesh.rpc.server import GrpcServer


async def _probe(address: str, *extra: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "llmesh.rpc.probe", address, *extra,
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, out.decode().strip()


async def test_probe_exits_0_only_while_the_server_is_serving():
    server = GrpcServer("127.0.0.1:0", [])
    await server.start()
    address = f"127.0.0.1:{server.port}"
    try:
        assert await _probe(address) == (0, "SERVING")
        await server.set_serving(False)  # draining
        assert await _probe(address) == (1, "NOT_SERVING")
        assert await _probe(address, "--service", "llmesh.v1.NoSuch") == (1, "UNREACHABLE")
    finally:
        await server.stop(0)
    assert await _probe(address, "--timeout", "0.5") == (1, "UNREACHABLE")

"""The Python floor of a streaming gRPC hop: the thinnest relay grpcio's asyncio API
allows (uvloop, one upstream channel, each message read, parsed and written on, no
stages, no logging, no metrics), run as its own process in front of an engine. The
load bench sets it beside the gateway: what it costs per request is what any
grpcio-aio gateway pays per streamed answer before doing anything of its own.

    python -m bench.grpc_relay --port 9000 --upstream 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import grpc
import uvloop

from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.server import SERVER_OPTIONS
from llmesh.testing import port_open, terminate, wait_until
from llmesh.v1 import engine_pb2_grpc


class Relay(engine_pb2_grpc.EngineServicer):
    def __init__(self, upstream: engine_pb2_grpc.EngineStub):
        self._upstream = upstream

    async def Generate(self, request, context):  # noqa: N802 - the proto's method
        call = self._upstream.Generate(request, timeout=context.time_remaining())
        try:
            async for message in call:
                yield message
        finally:
            call.cancel()


async def serve(port: int, upstream: str) -> None:
    async with mesh_channel(upstream, "engine") as channel:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        engine_pb2_grpc.add_EngineServicer_to_server(Relay(engine_pb2_grpc.EngineStub(channel)), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()


def start(port: int, upstream: str) -> subprocess.Popen:
    """The relay as a child process, once its port answers."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.grpc_relay", "--port", str(port), "--upstream", upstream],
                            stdin=subprocess.DEVNULL)
    if not wait_until(lambda: port_open(port) or proc.poll() is not None, 30) or proc.poll() is not None:
        terminate(proc, 15, 5)
        raise RuntimeError("bench.grpc_relay did not start")
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="host:port of an llmesh Engine service")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.upstream))


if __name__ == "__main__":
    main()

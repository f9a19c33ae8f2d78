"""The engine client tells an engine that went away under a call (its process killed:
EngineLost) from one that was gone before the call reached it (a refused connection:
a plain Unavailable) and from a refusal an engine sends: real gRPC, a real sim engine
process killed by its fault switch (a marked prompt: SIGKILL), then started again on its port
(``connected``: the channel is back); and the rule on the errors grpc-core and Envoy give."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from opentelemetry.trace import INVALID_SPAN

from llmesh.errors import EngineLost, Unavailable
from llmesh.rpc.health import health_status
from llmesh.testing import Service, free_ports, wait_until_async
from llmesh.types import Message, Prompt, Sampling
from llmesh.gateway.context import CompletionRequest
from llmesh.gateway.upstream.engines import EngineClients, lost

MARKER = "llmesh-fault-die-component"


def request(text: str, model: str = "sim-small") -> CompletionRequest:
    return CompletionRequest(request_id="r1", tenant="t", model=model, timeout_s=10,
                             prompt=Prompt(messages=(Message("user", text),)), sampling=Sampling(max_tokens=3))


async def serving(address: str, timeout_s: float = 20.0) -> bool:
    for _ in range(int(timeout_s / 0.1)):
        if await health_status(address) == "SERVING":
            return True
        await asyncio.sleep(0.1)
    return False


async def drain(clients: EngineClients, address: str, req: CompletionRequest) -> list:
    return [item async for item in clients.generate(address, req, 10, INVALID_SPAN)]


async def test_a_killed_engine_is_lost_and_a_dead_address_is_not(tmp_path):
    port = free_ports(1)[0]
    engine = Service("llmesh.engine", {
        "LLMESH_ENGINE_BACKEND": "sim", "LLMESH_ENGINE_MODEL": "sim-small", "LLMESH_ENGINE_PORT": str(port),
        "LLMESH_ENGINE_SCHEDULER_ADDRESS": f"127.0.0.1:{free_ports(1)[0]}", "LLMESH_ENGINE_FAULT_INJECTION": "true",
        "LLMESH_ENGINE_SIM_DIE_ON": MARKER, "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "1"}, tmp_path / "engine.log")
    engine.start()
    address = f"127.0.0.1:{port}"
    clients = EngineClients()
    try:
        assert await serving(address), engine.log_path.read_text()
        assert await drain(clients, address, request("hello"))  # the channel is connected
        with pytest.raises(EngineLost) as info:
            await drain(clients, address, request(f"a {MARKER} b"))
        assert info.value.reason == "engine_lost" and address in info.value.message
        assert engine.proc.wait(timeout=10) == -signal.SIGKILL
        with pytest.raises(Unavailable) as info:  # gone before the call: refused, not lost under it
            await drain(clients, address, request("hello"))
        assert not isinstance(info.value, EngineLost)
        assert not clients.connected(address)

        # Restarted on its port: the channel connects again (after its reconnect backoff), and
        # then a call goes out: what the router waits for before it retries a lost request there.
        engine.start()
        assert await serving(address), engine.log_path.read_text()
        assert await wait_until_async(lambda: clients.connected(address), 10)
        assert await drain(clients, address, request("hello"))
    finally:
        engine.stop(signal.SIGKILL)
        await clients.close()


def rpc_error(code: grpc.StatusCode, details: str, trailers: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


@pytest.mark.parametrize(("code", "details", "trailers", "expected"), [
    (grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)", (), True),
    (grpc.StatusCode.UNAVAILABLE, "Stream removed (recvmsg:Connection reset by peer (104))", (), True),
    (grpc.StatusCode.UNAVAILABLE, "upstream connect error or disconnect/reset before headers. reset reason: "
                                  "connection termination", (), True),  # Envoy in between
    # gone before the call reached it: refused, or our send found the connection dead
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
                                  "Failed to connect to remote host: Connection refused", (), False),
    (grpc.StatusCode.UNAVAILABLE, "Stream removed (sendmsg: Broken pipe (32))", (), False),
    # a refusal the engine sent carries its reason
    (grpc.StatusCode.UNAVAILABLE, "Stream removed", (("llmesh-error-reason", "draining"),), False),
    (grpc.StatusCode.INTERNAL, "Stream removed", (), False),
])
def test_what_counts_as_lost(code, details, trailers, expected):
    assert lost(rpc_error(code, details, trailers)) is expected

"""Killing an engine mid-stream: the official openai client's stream (and a gRPC
stream) stays complete and well-formed; the gateway continued the answer on the
mesh's other sim-small engine. The killed engine is a real process (SIGKILL)."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from llmesh.engine.backends.sim import _WORDS
from llmesh.testing import free_ports, wait_until
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import endpoints, sim_engine

MAX_TOKENS = 40


@pytest.fixture
def doomed_engine(mesh, tmp_path):
    """A second sim-small engine, slow (40 ms a token), that the test kills."""
    port = free_ports(1)[0]
    svc = sim_engine("doomed", f"127.0.0.1:{port}", tmp_path / "engine.log",
                     scheduler_address=mesh.layout.address("scheduler"), sim_decode_ms_per_token=40)
    svc.start()
    assert wait_until(lambda: any(e.endpoint_id == "doomed" and e.healthy for e in endpoints(mesh)), 20)
    yield svc, f"127.0.0.1:{port}"
    svc.stop(signal.SIGKILL)


def running(address: str) -> int:
    try:
        with grpc.insecure_channel(address) as ch:
            return engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=1).load.running
    except grpc.RpcError:
        return 0


def well_formed(text: str) -> bool:
    words = text.split(" ")
    return len(words) == MAX_TOKENS and all(w in _WORDS for w in words)


def test_http_stream_survives_its_engine_being_killed(client, doomed_engine):
    svc, address = doomed_engine
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the gateway picks either sim-small engine: until one lands on the doomed one
        stream = client.chat.completions.create(model="sim-small", stream=True, max_tokens=MAX_TOKENS,
                                                temperature=0.7, messages=[{"role": "user", "content": "go"}],
                                                stream_options={"include_usage": True})
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 4:
                break
        if running(address):
            svc.stop(signal.SIGKILL)
            chunks.extend(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert well_formed(text), text
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert reasons == ["length"]
            assert chunks[-1].usage.completion_tokens == MAX_TOKENS
            return
        stream.close()
        time.sleep(0.2)  # the gateway may not have the new engine in its table yet
    pytest.fail("no stream went to the doomed engine")


def test_grpc_stream_survives_and_says_so_in_the_trailer(mesh, doomed_engine):
    svc, address = doomed_engine
    with grpc.insecure_channel(mesh.layout.address("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            call = stub.Chat(gateway_pb2.ChatRequest(
                model="sim-small", messages=[common_pb2.ChatMessage(role="user", content="go")],
                sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7)), timeout=30)
            replies = [next(call) for _ in range(4)]
            if running(address):
                svc.stop(signal.SIGKILL)
                replies.extend(call)
                assert well_formed("".join(r.text for r in replies))
                assert replies[-1].usage.completion_tokens == MAX_TOKENS
                assert dict(call.trailing_metadata())["x-llmesh-failover"] == "1"
                return
            call.cancel()
            time.sleep(0.2)
    pytest.fail("no stream went to the doomed engine")

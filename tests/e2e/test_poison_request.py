"""A request that kills the engine it lands on (a poison pill) takes down that one engine
only. The gateway holds it while `llmesh up` restarts the engine, tries it there once more
(the engine dies again), then refuses it (400 / INVALID_ARGUMENT, ``poison_request``, naming
the request id) instead of sending it to another engine, even though the model's policy
allows three; the other two engines never die and serve meanwhile. The engines are real sim
engine processes under `llmesh up`, with the sim backend's fault switch: a prompt carrying
the marker kills the process (SIGKILL) before it answers."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import openai
import pytest
from openai import OpenAI

from llmesh.testing import Mesh, free_layout, wait_until
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import endpoints

MARKER = "llmesh-fault-die-7f3a"
ENGINES = 3


# A mesh per test: after one poison request, the engine it killed stays out of the gateway's picks
# (its breaker) for a while after it is back, and the next test needs all three routable.
@pytest.fixture
def mesh(tmp_path_factory):
    d = tmp_path_factory.mktemp("poison")
    config = d / "llmesh.yaml"
    config.write_text("default: {max_attempts: 3}\n")  # room for other engines: the gateway must not use them
    m = Mesh(layout=free_layout(n_engines=ENGINES), engines=",".join(["sim"] * ENGINES), model_dir=d / "models",
             log_dir=d / "logs", env={"LLMESH_ENGINE_FAULT_INJECTION": "true", "LLMESH_ENGINE_SIM_DIE_ON": MARKER,
                                      "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "1", "LLMESH_CONFIG_FILE": str(config)})
    m.start(timeout_s=90)
    yield m
    assert m.stop() == 0, m.logs()


def all_healthy(mesh: Mesh) -> bool:
    return sum(e.healthy for e in endpoints(mesh)) == ENGINES


def deaths(mesh: Mesh) -> list[str]:
    """The engines `llmesh up` saw die so far, one entry per death."""
    return re.findall(r"(engine-\d+) exited with code -9", "".join(mesh.output))


def restarts(mesh: Mesh) -> dict[str, int]:
    state = json.loads((mesh.log_dir / "supervisor.json").read_text())
    return {c["name"]: c["restarts"] for c in state["children"] if c["name"].startswith("engine-")}


def chat_ok(client: OpenAI) -> bool:
    reply = client.chat.completions.create(model="sim-small", max_tokens=3,
                                           messages=[{"role": "user", "content": "hello"}])
    return bool(reply.choices[0].message.content)


def engines_lost_total(mesh: Mesh) -> float:
    text = httpx.get(f"http://127.0.0.1:{mesh.layout.metrics_port('gateway')}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llmesh_engines_lost_total{"))


def test_a_poison_request_kills_one_engine_twice_and_is_refused_naming_its_id(mesh):
    assert wait_until(lambda: all_healthy(mesh), 30)
    client = OpenAI(base_url=mesh.layout.http_url + "/v1", api_key="unused", max_retries=0)
    assert wait_until(lambda: chat_ok(client), 10)
    assert not deaths(mesh)

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="sim-small", max_tokens=3, extra_headers={"x-request-id": "pill-1"},
                                       messages=[{"role": "user", "content": f"please {MARKER} now"}])
    assert info.value.status_code == 400
    assert info.value.code == "poison_request"
    assert "pill-1" in info.value.message
    assert info.value.response.headers["x-request-id"] == "pill-1"

    assert wait_until(lambda: len(deaths(mesh)) == 2, 10), "".join(mesh.output)
    dead = deaths(mesh)
    assert len(dead) == 2 and dead[0] == dead[1]  # the same engine twice (once it was back); never another
    assert chat_ok(client)  # the others serve meanwhile
    assert engines_lost_total(mesh) == 2

    # `llmesh up` restarts it; then the whole fleet serves again, and the other two never died.
    assert wait_until(lambda: restarts(mesh)[dead[0]] == 2, 30), "".join(mesh.output)
    assert wait_until(lambda: all_healthy(mesh), 30)
    assert sum(restarts(mesh).values()) == 2
    assert chat_ok(client)


def test_grpc_callers_get_invalid_argument_naming_the_request_id(mesh):
    assert wait_until(lambda: all_healthy(mesh), 30)
    with grpc.insecure_channel(mesh.layout.address("gateway")) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Chat(gateway_pb2.ChatRequest(
            model="sim-small", messages=[common_pb2.ChatMessage(role="user", content=MARKER)]),
            metadata=(("x-request-id", "pill-2"),), timeout=60)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "pill-2" in info.value.details()
    trailers = dict(info.value.trailing_metadata())
    assert trailers["llmesh-error-reason"] == "poison_request" and trailers["x-request-id"] == "pill-2"
    assert wait_until(lambda: len(deaths(mesh)) == 2, 10)
    dead = deaths(mesh)
    assert len(dead) == 2 and dead[0] == dead[1]

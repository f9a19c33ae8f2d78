"""Degradation under load through a whole mesh: sim-small on one sim engine (two running slots,
no queue, 50 ms a token) and its smaller variant sim-mini on an engine of its own. The live
config degrades sim-small's standard class at saturation 1.0 to sim-mini with max_tokens 4.
An idle sim-small answers itself, unmarked; once two long streams hold both its slots, the
next request (HTTP and gRPC) is answered by sim-mini, capped, marked with x-llmesh-degraded,
its access record names sim-mini and llmesh_degraded_requests_total counts each policy."""

from __future__ import annotations

import json
import re
import threading
import time

import grpc
import httpx
import pytest

from llmesh.testing import Mesh, free_layout, wait_until
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import endpoints, sim_engine

MODEL, VARIANT, CAP = "sim-small", "sim-mini", 4
CONFIG = {"flow_control": {"enabled": True},
          "degradation": {MODEL: {"standard": {"saturation": 1.0, "max_tokens": CAP, "variant": VARIANT}}}}


@pytest.fixture(scope="module")
def degrading_mesh(tmp_path_factory, real_model_dir):
    root = tmp_path_factory.mktemp("degrade")
    config = root / "llmesh.yaml"
    config.write_text(json.dumps(CONFIG))
    layout = free_layout(n_engines=2)
    mesh = Mesh(layout=layout, engines="sim:1", model_dir=real_model_dir, log_dir=root / "logs",
                env={"LLMESH_CONFIG_FILE": str(config), "LLMESH_ENGINE_MAX_RUNNING": "2",
                     "LLMESH_ENGINE_MAX_WAITING": "0", "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "50",
                     "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "64", "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600",
                     "LLMESH_GATEWAY_AUDIT": "false"},
                args=["--no-cache"])
    mesh.start(timeout_s=240)
    mini = sim_engine("mini", layout.engine_address(1), root / "mini.log", model=VARIANT,
                      scheduler_address=layout.address("scheduler"), max_running=2, max_waiting=0,
                      sim_decode_ms_per_token=5, self_test_interval_s=600)
    mini.start()
    try:
        assert wait_until(lambda: sum(e.healthy for e in endpoints(mesh)) == 2, 60), endpoints(mesh)
        yield mesh
    finally:
        assert mini.stop() == 0, mini.log_path.read_text()
        assert mesh.stop() == 0, mesh.logs()


def chat(mesh: Mesh, max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(mesh.layout.http_url + "/v1/chat/completions", json=body, timeout=30)


def hold_both_slots(mesh: Mesh, release: threading.Event) -> list[threading.Thread]:
    """Two streams of 64 tokens (3.2 s each) on sim-small's two slots; returns once both streamed."""
    started = threading.Semaphore(0)

    def stream() -> None:
        body = {"model": MODEL, "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "go"}]}
        with httpx.stream("POST", mesh.layout.http_url + "/v1/chat/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            for i, _ in enumerate(resp.iter_lines()):
                if i == 0:
                    started.release()
                if release.is_set():
                    return

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    assert all(started.acquire(timeout=20) for _ in threads)
    return threads


def degraded_count(mesh: Mesh, policy: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{mesh.layout.metrics_port('gateway')}/metrics").text
    found = re.findall(r'^llmesh_degraded_requests_total\{([^}]*)\} (\S+)$', text, re.M)
    return sum(float(v) for labels, v in found
               if f'model="{MODEL}"' in labels and 'class="standard"' in labels and f'policy="{policy}"' in labels)


def test_a_saturated_model_answers_from_its_variant_capped_and_marked(degrading_mesh):
    mesh = degrading_mesh
    idle = chat(mesh, 8)
    assert idle.status_code == 200, idle.text
    assert "x-llmesh-degraded" not in idle.headers and idle.json()["usage"]["completion_tokens"] == 8
    assert degraded_count(mesh, "variant") == 0

    release = threading.Event()
    holders = hold_both_slots(mesh, release)
    try:
        busy = chat(mesh, 64)
        assert busy.status_code == 200, busy.text
        assert busy.headers["x-llmesh-degraded"] == "variant,max_tokens"
        assert busy.headers["x-llmesh-model"] == VARIANT
        answer = busy.json()
        assert answer["usage"]["completion_tokens"] == CAP and answer["choices"][0]["finish_reason"] == "length"
        with grpc.insecure_channel(mesh.layout.address("gateway")) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).Chat(gateway_pb2.ChatRequest(
                model=MODEL, messages=[common_pb2.ChatMessage(role="user", content="hi")],
                sampling=common_pb2.SamplingParams(max_tokens=64)), timeout=30)
            first = dict(call.initial_metadata())
            chunks = list(call)
            last = dict(call.trailing_metadata())
        assert first["x-llmesh-degraded"] == last["x-llmesh-degraded"] == "variant,max_tokens"
        assert first["x-llmesh-model"] == VARIANT
        assert chunks[-1].usage.completion_tokens == CAP
    finally:
        release.set()
        for t in holders:
            t.join(timeout=30)
    assert degraded_count(mesh, "variant") == degraded_count(mesh, "max_tokens") == 2
    rid = busy.headers["x-request-id"]
    assert wait_until(lambda: _access_model(mesh, rid) is not None, 5)
    assert _access_model(mesh, rid) == VARIANT  # usage is recorded for the model that served


def _access_model(mesh: Mesh, request_id: str) -> str | None:
    for line in (mesh.log_dir / "gateway.log").read_text().splitlines():
        if request_id in line and (record := json.loads(line)).get("msg") == "request":
            return record.get("model")
    return None


def test_once_the_load_is_gone_answers_are_whole_again(degrading_mesh):
    mesh = degrading_mesh
    assert wait_until(lambda: all(e.load.running == 0 for e in endpoints(mesh)), 15)
    time.sleep(0.5)  # the gateway's table follows the scheduler's
    again = chat(mesh, 8)
    assert again.status_code == 200 and "x-llmesh-degraded" not in again.headers
    assert again.json()["usage"]["completion_tokens"] == 8

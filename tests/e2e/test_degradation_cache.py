"""Degradation's cache policy through a whole mesh (`llmesh up`: a sim engine with two running
slots and no queue, the cache service with the real MiniLM): sim-small's cache is semantic at a
strict 0.95, and its standard class, once saturated, may be answered at 0.9. With both slots
held, a paraphrase at ~0.937 of a stored question is answered from the cache, marked
``x-llmesh-degraded: cache`` (an HTTP header; gRPC metadata on the gRPC front) and counted in
llmesh_degraded_requests_total; idle again, one at
~0.919 misses, unmarked."""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import pytest

from llmesh.testing import Mesh, free_layout, wait_until
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import endpoints
from tests.e2e.test_degradation import degraded_count, hold_both_slots

MODEL = "sim-small"
STORED = "How do I reset my password?"
# MiniLM's cosine to STORED: ~0.937 and ~0.919, under the cache's own 0.95; the guards pass both
BUSY, IDLE = "Tell me how to reset my password.", "Can you explain how to reset my password?"
CONFIG = {"cache": {"mode": "semantic", "semantic_threshold": 0.95},
          "degradation": {MODEL: {"standard": {"saturation": 1.0, "cache_similarity": 0.9}}}}


@pytest.fixture(scope="module")
def cache_degrading_mesh(tmp_path_factory, real_model_dir):
    root = tmp_path_factory.mktemp("degrade-cache")
    config = root / "llmesh.yaml"
    config.write_text(json.dumps(CONFIG))
    mesh = Mesh(layout=free_layout(n_engines=1), engines="sim:1", model_dir=real_model_dir, log_dir=root / "logs",
                env={"LLMESH_CONFIG_FILE": str(config), "LLMESH_ENGINE_MAX_RUNNING": "2",
                     "LLMESH_ENGINE_MAX_WAITING": "0", "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "50",
                     "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "64", "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600",
                     "LLMESH_GATEWAY_AUDIT": "false", "LLMESH_GATEWAY_CACHE_BUDGET_S": "1.0"})
    mesh.start(timeout_s=240)
    try:
        assert wait_until(lambda: any(e.healthy for e in endpoints(mesh)), 60), endpoints(mesh)
        yield mesh
    finally:
        assert mesh.stop() == 0, mesh.logs()


def ask(mesh: Mesh, question: str) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": question}]}
    resp = httpx.post(mesh.layout.http_url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


def test_a_saturated_model_answers_a_near_paraphrase_from_the_cache_marked(cache_degrading_mesh):
    mesh = cache_degrading_mesh
    first = ask(mesh, STORED)
    assert first.headers.get("x-llmesh-cache") != "hit" and "x-llmesh-degraded" not in first.headers
    assert wait_until(lambda: ask(mesh, STORED).headers.get("x-llmesh-cache") == "hit", 10)  # stored
    release = threading.Event()
    holders = hold_both_slots(mesh, release)
    try:
        busy = ask(mesh, BUSY)
        with grpc.insecure_channel(mesh.layout.address("gateway")) as ch:  # the same, marked in gRPC metadata
            call = gateway_pb2_grpc.GatewayStub(ch).Chat(gateway_pb2.ChatRequest(
                model=MODEL, messages=[common_pb2.ChatMessage(role="user", content=BUSY)],
                sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0)), timeout=30)
            marked = dict(call.initial_metadata())
            text = "".join(c.text for c in call)
    finally:
        release.set()
        for t in holders:
            t.join(timeout=30)
    assert busy.headers.get("x-llmesh-cache") == "hit", busy.headers
    assert busy.headers["x-llmesh-degraded"] == "cache"
    assert busy.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert marked.get("x-llmesh-degraded") == "cache" and marked.get("x-llmesh-cache") == "hit", marked
    assert text == first.json()["choices"][0]["message"]["content"]
    assert degraded_count(mesh, "cache") == 2
    assert wait_until(lambda: all(e.load.running == 0 for e in endpoints(mesh)), 15)
    time.sleep(0.5)  # the gateway's table follows the scheduler's
    idle = ask(mesh, IDLE)  # idle: the cache's own 0.95 holds, nothing is degraded
    assert idle.headers.get("x-llmesh-cache") != "hit" and "x-llmesh-degraded" not in idle.headers
    assert degraded_count(mesh, "cache") == 2

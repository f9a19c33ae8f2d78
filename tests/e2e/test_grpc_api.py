"""The mesh over gRPC: health and reflection on every service, the Gateway's
streaming chat, cancellation and deadlines reaching the engine."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llmesh.testing import wait_until
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import SMOL
from tests.e2e.test_openai_api import engine_load


def chat_request(model: str, text: str, **sampling) -> gateway_pb2.ChatRequest:
    return gateway_pb2.ChatRequest(model=model, messages=[common_pb2.ChatMessage(role="user", content=text)],
                                   sampling=common_pb2.SamplingParams(**sampling))


@pytest.fixture(scope="module")
def gateway(mesh):
    with grpc.insecure_channel(mesh.layout.address("gateway")) as ch:
        yield gateway_pb2_grpc.GatewayStub(ch)


def all_addresses(mesh) -> dict[str, str]:
    lay = mesh.layout
    out = {s: lay.address(s) for s in ("gateway", "scheduler", "modelmgr", "cache")}
    out["engine-0"] = lay.engine_address(0)
    out["engine-1"] = lay.engine_address(1)
    return out


SERVICE_NAMES = {"gateway": "llmesh.v1.Gateway", "scheduler": "llmesh.v1.Scheduler",
                 "modelmgr": "llmesh.v1.ModelManager", "cache": "llmesh.v1.Cache",
                 "engine-0": "llmesh.v1.Engine", "engine-1": "llmesh.v1.Engine"}


def test_every_service_is_serving_and_reflects_its_api(mesh):
    for name, address in all_addresses(mesh).items():
        with grpc.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", SERVICE_NAMES[name]):
                resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING, (name, service)
            reflect = reflection_pb2_grpc.ServerReflectionStub(ch)
            answer = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                list_services="")]), timeout=2))
            names = {s.name for s in answer.list_services_response.service}
            assert {SERVICE_NAMES[name], "grpc.health.v1.Health"} <= names


def test_streaming_chat(gateway):
    call = gateway.Chat(chat_request(SMOL, "What is 2+2?", temperature=0.0, max_tokens=30), timeout=60,
                        metadata=(("x-request-id", "grpc-test-1"),))
    chunks = list(call)
    assert chunks[0].role == "assistant" and chunks[0].model == SMOL and chunks[0].text
    text = "".join(c.text for c in chunks)
    assert "4" in text
    last = chunks[-1]
    assert last.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert last.usage.prompt_tokens > 0 and 0 < last.usage.completion_tokens <= 30
    assert ("x-request-id", "grpc-test-1") in call.trailing_metadata()
    assert all(c.id == "chatcmpl-grpc-test-1" for c in chunks)


def test_list_models(gateway):
    assert SMOL in gateway.ListModels(gateway_pb2.GatewayListModelsRequest(), timeout=5).models


def test_cancel_mid_stream_frees_the_engine_slot(gateway, mesh):
    call = gateway.Chat(chat_request(SMOL, "Tell me a long story about a dragon.", temperature=0.8,
                                     max_tokens=1500), timeout=60)
    received = [next(call) for _ in range(4)]
    assert any(c.text for c in received)
    engine = mesh.layout.engine_address(0)
    assert engine_load(engine).running == 1
    call.cancel()
    assert wait_until(lambda: engine_load(engine).running == 0, 8.0)
    after = list(gateway.Chat(chat_request(SMOL, "Hi", max_tokens=3), timeout=30))
    assert after[-1].usage.completion_tokens == 3


def test_deadline_exceeded_travels_to_the_engine(gateway, tight_engine):
    with pytest.raises(grpc.RpcError) as info:
        list(gateway.Chat(chat_request("sim-tight", "slow please"), timeout=0.4))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: engine_load(tight_engine).running == 0, 2.0)


@pytest.mark.parametrize("request_, code", [
    (chat_request(SMOL, "x", temperature=3.0), grpc.StatusCode.INVALID_ARGUMENT),
    (chat_request("no-such-model", "x"), grpc.StatusCode.NOT_FOUND),
    (gateway_pb2.ChatRequest(model=SMOL), grpc.StatusCode.INVALID_ARGUMENT),
    (chat_request("unserved-model", "x"), grpc.StatusCode.UNAVAILABLE),
])
def test_errors_carry_status_codes(gateway, request_, code):
    with pytest.raises(grpc.RpcError) as info:
        list(gateway.Chat(request_, timeout=10))
    assert info.value.code() == code
    assert info.value.details()


def test_status_shows_services_endpoints_models_and_live_figures(mesh, client):
    import json
    import subprocess
    import sys

    client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    lay = mesh.layout
    args = [sys.executable, "-m", "llmesh", "status", "--base-port", str(lay.base_port),
            "--http-port", str(lay.http_port)]
    out = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert {s["name"] for s in report["services"]} >= {"gateway", "scheduler", "modelmgr", "cache", "engine-0"}
    assert {m["name"] for m in report["models"]} >= {SMOL}
    live = report["live"]
    assert live["requests_total"] >= 1 and live["ttft_ms_p50"] > 0 and live["ttft_ms_p99"] >= live["ttft_ms_p50"]
    smol = next(e for e in live["engines"] if e["endpoint_id"] == "engine-0")
    assert 0 <= smol["kv_cache_usage"] <= 1  # idle: cached prefixes don't count as used (as in vLLM)
    assert smol["kv_blocks"] >= 1  # ... but their blocks stay cached, as the scheduler was told
    text = subprocess.run(args, capture_output=True, text=True, timeout=60).stdout
    assert "req/s" in text and "TTFT p50" in text and "KV " in text


def test_engines_report_hardware_and_a_passing_self_test(mesh):
    import os

    from tests.e2e.conftest import endpoints

    table = {e.endpoint_id: e for e in endpoints(mesh)}
    for eid in ("engine-0", "engine-1"):
        e = table[eid]
        assert e.hardware.cpu_cores == os.cpu_count() and e.hardware.memory_total_bytes > 0
        assert e.hardware.cpu_model
        assert e.self_test.ok and e.self_test.checked_unix > 0 and e.self_test.latency_ms > 0

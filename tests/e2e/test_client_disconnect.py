"""A client that goes away stops the engine's work: a sim mesh (slow steps, long
answers), an HTTP client that times out on a non-streamed request and on a streamed
one before its first token; the engine's running count drops to 0, the access log
says "cancelled" and the tenant's concurrency lease is given back. And a gRPC error
keeps the trailers the servicer set (x-request-id) next to the error's own."""

from __future__ import annotations

import json
import re
import threading

import grpc
import httpx
import pytest

from llmesh.testing import Mesh, free_layout, wait_until
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

SIM = "sim-small"
RUNNING = re.compile(r'^vllm:num_requests_running\{[^}]*\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    root = tmp_path_factory.mktemp("disconnect")
    config = root / "llmesh.yaml"
    # One request at a time per tenant: a lease not given back refuses the next request.
    config.write_text(json.dumps({"rate_limits": {"*": {"max_concurrency": 1}}}))
    m = Mesh(layout=free_layout(n_engines=1), engines="sim", model_dir=root / "models", log_dir=root / "logs",
             env={"LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "20", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "5000",
                  "LLMESH_ENGINE_SIM_PREFILL_MS_PER_TOKEN": "5", "LLMESH_CONFIG_FILE": str(config)},
             args=["--no-cache"])
    m.start(timeout_s=90)
    yield m
    assert m.stop() == 0, m.logs()


def running(mesh: Mesh) -> int:
    text = httpx.get(f"http://127.0.0.1:{mesh.layout.metrics_port('engine-0')}/metrics", timeout=5).text
    return int(sum(float(v) for v in RUNNING.findall(text)))


def access_record(mesh: Mesh, rid: str) -> dict | None:
    for line in (mesh.log_dir / "gateway.log").read_text().splitlines():
        if rid in line and '"request"' in line:
            record = json.loads(line)
            if record.get("msg") == "request":
                return record
    return None


def give_up_early(mesh: Mesh, body: dict, rid: str) -> None:
    """Sends ``body`` and times out while the engine works on it; checks it was working."""
    seen_running: list[bool] = []

    def watch() -> None:
        seen_running.append(wait_until(lambda: running(mesh) == 1, 10))

    watcher = threading.Thread(target=watch)
    watcher.start()
    with httpx.Client(base_url=mesh.layout.http_url, timeout=3) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json=body, headers={"x-request-id": rid})
    watcher.join()
    assert seen_running == [True], "the engine never ran the request"


def check_stopped(mesh: Mesh, rid: str) -> None:
    assert wait_until(lambda: running(mesh) == 0, 2.5), "the engine kept generating for a client that left"
    assert wait_until(lambda: access_record(mesh, rid) is not None, 5), \
        (mesh.log_dir / "gateway.log").read_text()[-3000:]
    assert access_record(mesh, rid)["status"] == "cancelled"
    # The cancelled request's concurrency lease is settled: the next request is admitted.
    answer = httpx.post(mesh.layout.http_url + "/v1/chat/completions", timeout=30, json={
        "model": SIM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    # A client that stays to the end still gets the whole stream.
    with httpx.Client(base_url=mesh.layout.http_url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json={
                "model": SIM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "stream": True}) as streamed:
            assert streamed.status_code == 200
            assert [line for line in streamed.iter_lines() if line][-1] == "data: [DONE]"


def test_non_streamed_request_is_cancelled_when_the_client_leaves(mesh):
    body = {"model": SIM, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000}
    give_up_early(mesh, body, "gone-whole")
    check_stopped(mesh, "gone-whole")


def test_streamed_request_is_cancelled_before_its_first_token(mesh):
    # 1500 prompt words at 5 ms each: 7.5 s of prefill, so no token comes before the client leaves.
    body = {"model": SIM, "messages": [{"role": "user", "content": "word " * 1500}], "max_tokens": 1000,
            "stream": True}
    give_up_early(mesh, body, "gone-stream")
    check_stopped(mesh, "gone-stream")
    assert access_record(mesh, "gone-stream")["ttft_ms"] is None  # it left before the first token


def test_grpc_error_trailers_keep_the_request_id(mesh):
    with grpc.insecure_channel(mesh.layout.address("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        call = stub.Chat(gateway_pb2.ChatRequest(model="no-such-model", messages=[
            common_pb2.ChatMessage(role="user", content="hi")]), metadata=(("x-request-id", "grpc-err-1"),),
            timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    trailers = dict(err.value.trailing_metadata())
    assert trailers["x-request-id"] == "grpc-err-1"
    assert trailers["llmesh-error-reason"]  # the error's own trailers are still there


def test_streamed_request_is_cancelled_after_its_first_token(mesh):
    body = {"model": SIM, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000, "stream": True}
    with httpx.Client(base_url=mesh.layout.http_url, timeout=10) as client:
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers={"x-request-id": "gone-midway"}) as answer:
            assert answer.status_code == 200
            lines = answer.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert running(mesh) == 1
    check_stopped(mesh, "gone-midway")
    assert access_record(mesh, "gone-midway")["ttft_ms"] is not None

"""The metrics port's plaintext health (llmesh.metrics_http): GET /healthz and /readyz answer
200 SERVING or 503 NOT_SERVING from the state the gRPC health service writes (llmesh.serving),
and reveal nothing else; /metrics is unchanged."""

from __future__ import annotations

import threading

import httpx
from prometheus_client import CollectorRegistry, Counter

from llmesh.metrics_http import serve_metrics
from llmesh.rpc.server import GrpcServer
from llmesh.serving import ServingState


def test_serving_state_is_one_flag_readable_from_any_thread():
    state = ServingState()
    assert (state.serving, state.status) == (False, "NOT_SERVING")  # nothing serves before it starts
    seen: list[str] = []
    state.set(True)
    reader = threading.Thread(target=lambda: seen.append(state.status))
    reader.start()
    reader.join()
    assert seen == ["SERVING"]
    state.set(False)
    assert state.status == "NOT_SERVING"


async def test_healthz_answers_the_grpc_health_state_and_nothing_else():
    registry = CollectorRegistry()
    Counter("llmesh_probe_test", "a metric", registry=registry).inc()
    serving = ServingState()
    server = serve_metrics(registry, "127.0.0.1", 0, serving)
    grpc_server = GrpcServer("127.0.0.1:0", [], serving=serving)
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        for path in ("/healthz", "/readyz"):
            r = httpx.get(base + path, timeout=5)
            assert (r.status_code, r.text) == (503, "NOT_SERVING\n")
        await grpc_server.start()
        for path in ("/healthz", "/readyz"):
            r = httpx.get(base + path, timeout=5)
            assert (r.status_code, r.text) == (200, "SERVING\n")
            assert r.headers["content-type"] == "text/plain; charset=utf-8"
            assert r.headers["cache-control"] == "no-store"
        await grpc_server.set_serving(False)  # draining
        assert httpx.get(base + "/healthz", timeout=5).status_code == 503
        await grpc_server.set_serving(True)
        assert httpx.head(base + "/healthz", timeout=5).status_code == 200
        assert "llmesh_probe_test_total 1.0" in httpx.get(base + "/metrics", timeout=5).text
        await grpc_server.stop(0)  # a stopped server is NOT_SERVING, to the gRPC health and here alike
        assert httpx.get(base + "/healthz", timeout=5).text == "NOT_SERVING\n"
    finally:
        await grpc_server.stop(0)
        server.shutdown()
        server.server_close()


def test_without_a_state_there_is_no_health_path():
    server = serve_metrics(CollectorRegistry(), "127.0.0.1", 0)
    try:
        text = httpx.get(f"http://127.0.0.1:{server.server_port}/healthz", timeout=5).text
        assert "SERVING" not in text  # the plain metrics app, as before
    finally:
        server.shutdown()
        server.server_close()


def test_a_loop_that_stops_beating_is_not_serving():
    """/healthz is answered from the metrics thread; the serving loop's heartbeat keeps a stuck
    loop (a blocking call on it) from reading as SERVING."""
    now = [100.0]
    state = ServingState(True, stall_s=10.0, clock=lambda: now[0])
    assert state.status == "SERVING"  # no heartbeat running: the flag alone answers
    state.beat()
    now[0] += 9.0
    assert state.status == "SERVING"
    now[0] += 2.0  # 11 s without a beat
    assert (state.serving, state.status) == (False, "NOT_SERVING")
    state.beat()
    assert state.status == "SERVING"
    state.set(False)
    assert state.status == "NOT_SERVING"  # the flag still wins


async def test_the_heartbeat_beats_from_the_loop():
    import asyncio

    now = [0.0]
    state = ServingState(True, stall_s=10.0, clock=lambda: now[0])
    task = asyncio.create_task(state.heartbeat(every_s=0.01))
    await asyncio.sleep(0.05)
    now[0] = 50.0
    await asyncio.sleep(0.05)  # beats again at 50
    assert state.status == "SERVING"
    task.cancel()
    now[0] = 61.0
    assert state.status == "NOT_SERVING"

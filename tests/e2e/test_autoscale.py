"""Queue-driven autoscaling with scale from zero, end to end: `llmesh up` with no
fixed engine and `--autoscale sim-scale=sim`. The first request finds no replica and
is held until the launcher's engine is up and warm; a load ramp scales the fleet to
max_replicas, idleness back to zero, with no failed request; the first request after
idle is held and answered; a hold past `autoscaling.hold_s` (switched live) is a 503
with Retry-After, UNAVAILABLE with retry-after over gRPC. Short policy values keep
it well under two minutes."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from llmesh.testing import Mesh, free_layout, wait_until
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

MODEL = "sim-scale"
N = 3
POLICY = (f"autoscaling:\n  hold_s: {{hold_s}}\n  retry_after_s: 2\n  models:\n"
          f"    {MODEL}: {{{{min_replicas: 0, max_replicas: {N}, waiting_per_replica: 2, max_wait_s: 20, "
          f"idle_s: 3, cooldown_s: 2}}}}\n")
ASK = [{"role": "user", "content": "Name three planets."}]


@pytest.fixture(scope="module")
def scaled(tmp_path_factory, real_model_dir):
    logs = tmp_path_factory.mktemp("autoscale")
    config = logs / "llmesh.yaml"
    config.write_text(POLICY.format(hold_s=30))
    layout = free_layout(n_engines=N)
    mesh = Mesh(layout=layout, engines="", model_dir=real_model_dir, log_dir=logs,
                args=["--no-cache", "--autoscale", f"{MODEL}=sim"],
                env={"LLMESH_CONFIG_FILE": str(config), "LLMESH_SCHEDULER_AUTOSCALE_INTERVAL_S": "0.2",
                     "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "20", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "8",
                     "LLMESH_ENGINE_MAX_RUNNING": "2", "LLMESH_ENGINE_MAX_WAITING": "64",
                     "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600"})
    mesh.start(timeout_s=120)
    yield mesh, config
    code = mesh.stop()
    assert code == 0, mesh.logs()


def scale(mesh: Mesh) -> scheduler_pb2.ModelScale | None:
    with grpc.insecure_channel(mesh.layout.address("scheduler")) as ch:
        state = scheduler_pb2_grpc.SchedulerStub(ch).GetScale(scheduler_pb2.GetScaleRequest(), timeout=5)
    return next((m for m in state.models if m.model == MODEL), None)


def replicas(mesh: Mesh) -> int:
    with grpc.insecure_channel(mesh.layout.address("scheduler")) as ch:
        table = scheduler_pb2_grpc.SchedulerStub(ch).ListEndpoints(scheduler_pb2.ListEndpointsRequest(), timeout=5)
    return sum(1 for e in table.endpoints if MODEL in e.models and e.healthy)


def running_engines(logs: Path) -> set[str]:
    """Engines the supervisor runs now (its state file)."""
    state = json.loads((logs / "supervisor.json").read_text())
    return {c["name"] for c in state["children"] if c["name"].startswith("engine-") and c["alive"]}


def held_ms(logs: Path, request_id: str) -> float:
    for line in (logs / "gateway.log").read_text().splitlines():
        if request_id in line and '"held_ms"' in line:
            return json.loads(line)["held_ms"]
    raise AssertionError(f"no access record with held_ms for {request_id}")


def cold_request(mesh: Mesh, logs: Path, rid: str) -> float:
    client = OpenAI(base_url=mesh.layout.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                            extra_headers={"x-request-id": rid})
    assert answer.choices[0].message.content
    return held_ms(logs, rid)


def config_revision(mesh: Mesh) -> float:
    text = httpx.get(f"http://127.0.0.1:{mesh.layout.metrics_port('gateway')}/metrics").text
    found = re.search(r'^llmesh_config_revision\{service="gateway"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_for_zero(mesh: Mesh, timeout_s: float = 30) -> None:
    assert wait_until(lambda: (s := scale(mesh)) is not None and s.desired == 0 and replicas(mesh) == 0
                      and not running_engines(mesh.log_dir), timeout_s, 0.2), (scale(mesh), mesh.logs())


async def ramp(url: str, stages: list[tuple[int, float]], enough=lambda: False) -> tuple[int, list[str]]:
    """Closed-loop load: for each (concurrency, seconds) stage, that many clients send
    one request after another; a stage of more than 10 s ends early once ``enough()``
    (a slow machine starts engines slowly). Returns the number answered and every failure."""
    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    done, failures = 0, []

    async def worker(until: float, may_end: bool) -> None:
        nonlocal done
        while time.monotonic() < until and not (may_end and enough()):
            try:
                a = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8)
                assert a.choices[0].message.content
                done += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                failures.append(repr(exc))

    try:
        for concurrency, seconds in stages:
            until = time.monotonic() + seconds
            await asyncio.gather(*(worker(until, seconds > 10) for _ in range(concurrency)))
    finally:
        await client.close()
    return done, failures


def test_scales_from_zero_to_n_and_back_without_failing_a_request(scaled):
    mesh, config = scaled
    logs = mesh.log_dir
    assert wait_until(lambda: scale(mesh) is not None, 10)
    assert scale(mesh).desired == 0 and replicas(mesh) == 0 and not running_engines(logs)

    # From zero: the first request is held while a replica starts and warms, then answered.
    started = time.monotonic()
    held = cold_request(mesh, logs, "cold-1")
    assert held > 100, held                     # it waited for an engine process to start
    assert time.monotonic() - started < 30
    assert replicas(mesh) == 1

    # A ramp: more than 2 waiting per replica scales up to N; nothing fails on the way.
    peak = {"replicas": 0}
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            peak["replicas"] = max(peak["replicas"], replicas(mesh))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        done, failures = asyncio.run(ramp(mesh.layout.http_url + "/v1", [(2, 2.0), (6, 3.0), (12, 30.0), (4, 2.0)],
                                          enough=lambda: peak["replicas"] == N))
    finally:
        watching.set()
        watcher.join()
    assert failures == [], failures[:5]
    assert done > 50
    assert peak["replicas"] == N, peak
    metrics = httpx.get(f"http://127.0.0.1:{mesh.layout.metrics_port('scheduler')}/metrics").text
    assert re.search(rf'^llmesh_scheduler_replicas\{{kind="desired",model="{MODEL}"\}} \d', metrics, re.M), metrics
    assert re.search(rf'^llmesh_scheduler_queue_depth\{{model="{MODEL}"\}} \d', metrics, re.M)
    assert re.search(rf'^llmesh_scheduler_scale_changes_total\{{model="{MODEL}",reason="up"\}} [1-9]', metrics, re.M)

    # Idle: back to zero (idle_s 3, cooldown 2); every engine drained and gone.
    wait_for_zero(mesh)

    # The first request after idle is held and answered.
    assert cold_request(mesh, logs, "cold-2") > 100
    wait_for_zero(mesh)

    # A hold past hold_s (switched live to 0.2 s; an engine takes longer to start): 503 with
    # Retry-After in OpenAI's error body, UNAVAILABLE with retry-after over gRPC.
    before = config_revision(mesh)
    config.write_text(POLICY.format(hold_s=0.2))
    assert wait_until(lambda: config_revision(mesh) > before, 10)
    client = OpenAI(base_url=mesh.layout.http_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
    err = refused.value
    assert err.status_code == 503 and err.response.headers["retry-after"] == "2"
    assert err.body["code"] == "scaling_up" and "starting" in err.body["message"]
    # its demand starts a replica; this request comes before it is ready
    with grpc.insecure_channel(mesh.layout.address("gateway")) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(gateway_pb2_grpc.GatewayStub(ch).Chat(gateway_pb2.ChatRequest(
                model=MODEL, messages=[common_pb2.ChatMessage(role="user", content="hi")]), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(info.value.trailing_metadata())["retry-after"] == "2"

"""Traffic through the real gateway to real sim engines (`llmesh up` plus engines
started on their own): a weighted split holds its ratio over 5,000 requests and
keeps each user on one version, and a request every engine refuses for a full
queue gets 429 with Retry-After (HTTP) or RESOURCE_EXHAUSTED with the hint in the
trailing metadata (gRPC), told apart from a tenant's rate limit."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import time
import uuid
from pathlib import Path

import aiohttp
import grpc
import httpx
import pytest
from google.rpc import error_details_pb2, status_pb2

from llmesh.testing import Mesh, children_of, free_layout, wait_until
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import endpoints, sim_engine

SPLIT = {"sim-small": 80, "sim-next": 20}  # the alias "assistant": the mesh's own sim engine, and one more
RETRY_AFTER_S = 2
BUSY = ("busy-a", "busy-b")  # two engines of "sim-busy": one slot and a queue of one each, 100 ms a token


def engine_load(address: str) -> engine_pb2.EngineLoad:
    with grpc.insecure_channel(address) as ch:
        return engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=2).load


@pytest.fixture(scope="module")
def traffic_mesh(tmp_path_factory, real_model_dir: Path):
    config = tmp_path_factory.mktemp("traffic-config") / "llmesh.yaml"
    targets = ", ".join(f"{{model: {m}, weight: {w}}}" for m, w in SPLIT.items())
    config.write_text(f"default: {{max_attempts: 2}}\nsplits:\n  assistant:\n    targets: [{targets}]\n")
    logs = tmp_path_factory.mktemp("traffic")
    layout = free_layout(n_engines=4)
    fast = {"LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "0", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "2",
            "LLMESH_ENGINE_MAX_RUNNING": "64", "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600"}
    mesh = Mesh(layout=layout, engines="sim", model_dir=real_model_dir, log_dir=logs, args=["--no-cache"],
                env={**fast, "LLMESH_CONFIG_FILE": str(config),
                     "LLMESH_GATEWAY_QUEUE_FULL_RETRY_AFTER_S": str(RETRY_AFTER_S)})
    mesh.start()
    common = {"LLMESH_ENGINE_BACKEND": "sim", "LLMESH_ENGINE_SCHEDULER_ADDRESS": layout.address("scheduler"),
              "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600"}
    extra = [("sim-next", "next", fast), *((("sim-busy", name, {
        "LLMESH_ENGINE_MAX_RUNNING": "1", "LLMESH_ENGINE_MAX_WAITING": "1",
        "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "100"}) for name in BUSY))]
    services, engines = [], {}
    try:
        for i, (model, endpoint_id, env) in enumerate(extra, start=1):
            address = layout.engine_address(i)
            svc = sim_engine(endpoint_id, address, logs / f"{endpoint_id}.log", model=model, env={**common, **env})
            svc.start()
            services.append(svc)
            engines[endpoint_id] = svc.proc.pid
        wanted = {"engine-0", "next", *BUSY}
        assert wait_until(lambda: wanted <= {e.endpoint_id for e in endpoints(mesh) if e.healthy}, 60), \
            mesh.logs()
        yield mesh, engines
    finally:
        for svc in services:
            assert svc.stop() == 0, svc.log_path.read_text()[-3000:]
        assert mesh.stop() == 0, mesh.logs()


def cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each process has used so far; "client" is this one."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["client"] = usage.ru_utime + usage.ru_stime
    return out


def mesh_pids(mesh: Mesh) -> dict[str, int]:
    names = {}
    for pid in children_of(mesh.proc.pid):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        names[cmd[2].decode().removeprefix("llmesh.") if len(cmd) > 2 else str(pid)] = pid
    return names


def served_by(mesh: Mesh, ids: set[str]) -> dict[str, str]:
    """request id -> the model that answered it, from the gateway's access log."""
    lines = (mesh.log_dir / "gateway.log").read_text().splitlines()
    records = (json.loads(x) for x in lines if x.startswith("{"))
    return {r["request_id"]: r["model"] for r in records
            if r.get("msg") == "request" and r.get("request_id") in ids and r["status"] == "ok"}


def test_split_ratio_over_5000_requests_and_sticky_users(traffic_mesh):
    mesh, engines = traffic_mesh
    """5,000 users, one request each, through the gateway's HTTP front: each arm gets its
    weight's share within 2 points. Then 100 of them come back 4 times each: every one
    lands on the version it got the first time."""
    first = [(f"user-{i}", f"split-{uuid.uuid4().hex}") for i in range(5000)]
    again = [(f"user-{i}", f"again-{uuid.uuid4().hex}") for i in range(0, 5000, 50) for _ in range(4)]

    async def send(calls: list[tuple[str, str]]) -> list[int]:
        # aiohttp: a tenth of httpx's client CPU a request, which on a shared 2-core machine is the wall time
        async with aiohttp.ClientSession(base_url=mesh.layout.http_url, connector=aiohttp.TCPConnector(limit=32),
                                         timeout=aiohttp.ClientTimeout(total=60)) as http:
            sem = asyncio.Semaphore(32)

            async def one(user: str, rid: str) -> int:
                async with sem, http.post("/v1/chat/completions", headers={"x-request-id": rid}, json={
                        "model": "assistant", "user": user, "max_tokens": 2,
                        "messages": [{"role": "user", "content": "hello"}]}) as resp:
                    await resp.read()
                    return resp.status
            return await asyncio.gather(*(one(u, r) for u, r in calls))

    pids = {**mesh_pids(mesh), "engine-next": engines["next"]}
    cpu0, t0 = cpu_s(pids), time.monotonic()
    statuses = asyncio.run(send(first)) + asyncio.run(send(again))
    elapsed, cpu1 = time.monotonic() - t0, cpu_s(pids)
    n = len(statuses)
    # What one request costs each process (ms of CPU), for the report when this runs long.
    print(json.dumps({"requests": n, "wall_s": round(elapsed, 1), "cpu_ms_per_request": {
        k: round((cpu1[k] - cpu0[k]) * 1000 / n, 2) for k in cpu1}, "loadavg": os.getloadavg()}))
    assert statuses.count(200) == len(first) + len(again), {s: statuses.count(s) for s in set(statuses)}
    ids = {rid for _, rid in first + again}
    assert wait_until(lambda: len(served_by(mesh, ids)) == len(ids), 10)
    models = served_by(mesh, ids)

    total = sum(SPLIT.values())
    for model, weight in SPLIT.items():
        share = sum(models[rid] == model for _, rid in first) / len(first)
        assert abs(share - weight / total) <= 0.02, (model, share)
    version = {user: models[rid] for user, rid in first}
    moved = [(user, version[user], models[rid]) for user, rid in again if models[rid] != version[user]]
    assert not moved, moved


def test_every_queue_full_is_429_with_retry_after(traffic_mesh):
    lay = traffic_mesh[0].layout
    addresses = [lay.engine_address(2), lay.engine_address(3)]
    body = {"model": "sim-busy", "messages": [{"role": "user", "content": "fill"}], "max_tokens": 40}  # 4 s

    def rate_limited() -> float:
        text = httpx.get(f"http://127.0.0.1:{lay.metrics_port('gateway')}/metrics").text
        return sum(float(v) for v in re.findall(r"^llmesh_rate_limited_requests_total\{[^}]*\} (\S+)$", text, re.M))

    async def run() -> None:
        async with httpx.AsyncClient(base_url=lay.http_url, timeout=60) as http:
            # Two running and two queued fill both engines (the gateway retries a full one on the other).
            held = [asyncio.create_task(http.post("/v1/chat/completions", json=body)) for _ in range(4)]
            try:
                def full() -> bool:
                    return all((x := engine_load(a)).running == 1 and x.waiting == 1 for a in addresses)
                for _ in range(100):
                    if full():
                        break
                    await asyncio.sleep(0.05)
                assert full(), [engine_load(a) for a in addresses]
                before = rate_limited()
                for stream in (False, True):
                    resp = await http.post("/v1/chat/completions", json={**body, "stream": stream})
                    assert resp.status_code == 429, resp.text
                    assert resp.headers["retry-after"] == str(RETRY_AFTER_S)
                    assert resp.headers["retry-after-ms"] == str(RETRY_AFTER_S * 1000)
                    error = resp.json()["error"]
                    assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
                    assert "sim-busy" in error["message"] and "capacity" in error["message"]
                with grpc.insecure_channel(lay.address("gateway")) as ch:
                    call = gateway_pb2_grpc.GatewayStub(ch).Chat(gateway_pb2.ChatRequest(
                        model="sim-busy", messages=[common_pb2.ChatMessage(role="user", content="fill")]), timeout=10)
                    with pytest.raises(grpc.RpcError) as info:
                        list(call)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                trailer = dict(info.value.trailing_metadata())
                assert trailer["llmesh-error-reason"] == "queue_full"
                assert trailer["retry-after"] == str(RETRY_AFTER_S)
                status = status_pb2.Status.FromString(trailer["grpc-status-details-bin"])  # gRPC's rich error model
                hint = error_details_pb2.RetryInfo()
                assert status.details[0].Unpack(hint) and hint.retry_delay.seconds == RETRY_AFTER_S
                assert rate_limited() == before  # not counted as a tenant's rate limit
            finally:
                done = await asyncio.gather(*held, return_exceptions=True)
            # The admitted requests were served in full, and once the engines have room a retry is too.
            assert [getattr(r, "status_code", r) for r in done] == [200] * 4
            resp = await http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text

    asyncio.run(run())

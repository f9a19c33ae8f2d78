"""Chaos: `llmesh up --engines sim:3` under 200 concurrent streaming clients while one
engine is killed (SIGKILL) or terminated (SIGTERM), or a control-plane service is killed. Each
scenario prints completed / failed / broken streams and asserts the promise of
docs/reliability.md:

- kill -9: no request that had not yet received a token fails (the gateway retries
  it on another engine); streams already under way on the dead engine break (there
  is no mid-stream failover yet), and are counted;
- SIGTERM: nothing fails (the engine leaves the table first, then finishes its streams);
- the scheduler, modelmgr or the cache killed: nothing fails (gateways route on their
  last table; the cache is skipped) and the engines register again with a restarted
  scheduler.

The supervisor restarts the engine meanwhile; the mesh never stops."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from llmesh.testing import Mesh, free_layout, wait_until
from tests.e2e.conftest import endpoints

pytestmark = pytest.mark.timeout(240)

CLIENTS = 200
LOAD_S = 8.0
FAULT_AT_S = 3.0


@pytest.fixture
def mesh(tmp_path):
    m = Mesh(layout=free_layout(n_engines=3), engines="sim:3", model_dir=tmp_path / "models",
             log_dir=tmp_path / "logs",
             env={"LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "20", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "30",
                  "LLMESH_ENGINE_MAX_RUNNING": "128", "LLMESH_ENGINE_MAX_WAITING": "256",
                  "LLMESH_GATEWAY_REQUEST_TIMEOUT_S": "60"})
    m.start(timeout_s=90)
    assert wait_until(lambda: sum(e.healthy for e in endpoints(m)) == 3, 20)
    yield m
    m.stop(signal.SIGKILL)


async def _one(http: httpx.AsyncClient, tally: dict) -> None:
    body = {"model": "sim-small", "stream": True, "messages": [{"role": "user", "content": "chaos"}]}
    tokens, finished = 0, False
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                tally["failed"] += 1
                tally["errors"].append(f"{resp.status_code} {resp.text[:120]}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    tally["errors"].append(chunk["error"]["message"][:120])
                    break
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                if (choice.get("delta") or {}).get("content"):
                    tokens += 1
                if choice.get("finish_reason"):
                    finished = True
    except httpx.HTTPError as exc:
        tally["errors"].append(f"{type(exc).__name__}: {exc}"[:120])
    if finished:
        tally["completed"] += 1
    elif tokens:
        tally["broken"] += 1
    else:
        tally["failed"] += 1


async def _load(mesh: Mesh, fault) -> dict:
    tally = {"completed": 0, "failed": 0, "broken": 0, "errors": [], "running_at_fault": 0}
    # A connection per request: a pooled keep-alive connection that uvicorn closes as idle (5 s) just
    # as it is reused fails the request with a ReadError that has nothing to do with the fault.
    limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=mesh.layout.http_url, timeout=60, limits=limits) as http:
        end = time.monotonic() + LOAD_S

        async def client() -> None:
            while time.monotonic() < end:
                await _one(http, tally)

        async def injector() -> None:
            # Strike while engine-1 is streaming to many clients, so a fault there hits streams in flight.
            await asyncio.sleep(FAULT_AT_S)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                tally["running_at_fault"] = await asyncio.to_thread(_running, mesh, "engine-1")
                if tally["running_at_fault"] >= 10:
                    break
                await asyncio.sleep(0.05)
            fault()

        await asyncio.gather(injector(), *(client() for _ in range(CLIENTS)))
    return tally


def _running(mesh: Mesh, endpoint_id: str) -> int:
    return next((e.load.running for e in endpoints(mesh) if e.endpoint_id == endpoint_id), 0)


def _engine_pid(mesh: Mesh, name: str) -> int:
    state = json.loads((mesh.log_dir / "supervisor.json").read_text())
    return next(c["pid"] for c in state["children"] if c["name"] == name)


def _report(scenario: str, tally: dict) -> None:
    errors = sorted(set(tally["errors"]))[:5]
    print(json.dumps({"scenario": scenario, "clients": CLIENTS, "load_s": LOAD_S,
                      **{k: tally[k] for k in ("running_at_fault", "completed", "failed", "broken")},
                      "sample_errors": errors}))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_losing_one_engine_of_three_under_200_streams(mesh, sig):
    pid = _engine_pid(mesh, "engine-1")
    tally = asyncio.run(_load(mesh, lambda: os.kill(pid, sig)))
    _report(f"engine-1 {signal.Signals(sig).name}", tally)
    assert mesh.proc.poll() is None, "the mesh stopped"
    assert tally["completed"] > CLIENTS and tally["running_at_fault"] >= 10
    # Mid-stream failover continues a dying engine's answers elsewhere: no stream breaks either.
    assert tally["failed"] == 0 and tally["broken"] == 0, tally["errors"][:5]
    assert wait_until(lambda: any("restarted engine-1" in line for line in mesh.output), 20)


@pytest.mark.parametrize("service", ["scheduler", "modelmgr", "cache"])
def test_losing_a_control_plane_service_under_200_streams(mesh, service):
    """Serving goes on while the scheduler (gateways route on their last endpoint table),
    modelmgr or the cache (skipped) is away; each is restarted, and the engines register
    with a restarted scheduler again."""
    pid = _engine_pid(mesh, service)
    tally = asyncio.run(_load(mesh, lambda: os.kill(pid, signal.SIGKILL)))
    _report(f"{service} SIGKILL", tally)
    assert mesh.proc.poll() is None, "the mesh stopped"
    assert tally["completed"] > CLIENTS
    assert tally["failed"] == 0 and tally["broken"] == 0, tally["errors"][:5]
    assert wait_until(lambda: sum(e.healthy for e in endpoints(mesh)) == 3, 20)

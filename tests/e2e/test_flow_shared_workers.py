"""Flow control shared by two gateway worker processes over a real Redis (LLMESH_GATEWAY_WORKERS=2,
services/gateway/stages/flow_shared.py), in front of one sim engine with two slots: the model's
queue bound holds over both workers together (one queue depth), every request that found room is
answered in turn, and a SIGKILLed worker's queued requests leave the shared queue once its
heartbeat lapses while the other worker's are served."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
import redis

from llmesh.testing import Mesh, free_layout, pid_alive, wait_until
from tests.e2e.test_gateway_workers import MODEL, Gateway, _models

SLOTS = 2
MAX_QUEUED = 4
CONFIG = {"tenants": {"*": {}}, "flow_control": {"enabled": True, "max_queued": MAX_QUEUED}}
PREFIX = "llmesh:fq:{" + MODEL + "}:"


@pytest.fixture(scope="module")
def slow_mesh(tmp_path_factory):
    d = tmp_path_factory.mktemp("shared-flow-mesh")
    m = Mesh(layout=free_layout(n_engines=1), engines="sim", model_dir=d / "models", log_dir=d / "logs",
             env={"LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "150", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "8",
                  "LLMESH_ENGINE_MAX_RUNNING": str(SLOTS), "LLMESH_ENGINE_MAX_WAITING": "0",
                  "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600"}, args=["--no-cache"])
    m.start(timeout_s=120)
    yield m
    assert m.stop() == 0, m.logs()


@pytest.fixture(scope="module")
def gateway(slow_mesh, redis_server, tmp_path_factory):
    out = subprocess.run([sys.executable, "-m", "llmesh", "keys", "create", "--tenant", "flood", "--redis-url",
                          redis_server.url], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    gw = Gateway(slow_mesh, redis_server.url, tmp_path_factory.mktemp("gw") / "gateway.log",
                 out.stdout.strip().splitlines()[-1])
    (gw.service.log_path.parent / "llmesh.yaml").write_text(json.dumps(CONFIG))
    gw.service.start()
    assert wait_until(lambda: any(r.get("msg") == "workers serving" for r in gw.log())
                      or gw.service.proc.poll() is not None, 60)
    assert gw.service.proc.poll() is None, gw.service.log_path.read_text()[-3000:]
    assert wait_until(lambda: _models(gw) == [MODEL] * 8, 30), gw.service.log_path.read_text()[-3000:]
    yield gw
    gw.service.stop(signal.SIGKILL)


async def _burst(gw: Gateway, n: int, refusals: list[httpx.Response] | None = None) -> list[int]:
    """``n`` streams at once, each on a connection of its own (the kernel spreads them over the workers);
    the answers other than 200 go to ``refusals``."""
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}

    async def one() -> int:
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                async with client.stream("POST", gw.url + "/v1/chat/completions", json=body,
                                         headers=gw.headers) as r:
                    await r.aread()
                    if r.status_code != 200 and refusals is not None:
                        refusals.append(r)
                    return r.status_code
        except httpx.HTTPError:  # its worker was killed under it
            return 0

    return list(await asyncio.gather(*(one() for _ in range(n))))


def _refusals(gw: Gateway) -> list[tuple]:
    """What the gateway's log says of each request that was not answered 200 (for failure messages)."""
    return [(r.get("worker"), r.get("msg"), r.get("reason") or r.get("status") or r.get("error"))
            for r in gw.log() if r.get("msg") == "request refused by flow control"
            or (r.get("logger") == "llmesh.gateway.access" and r.get("status") not in ("ok", None))
            or r.get("level") in ("WARNING", "ERROR")]


def _served_by(gw: Gateway) -> set[int]:
    return {r["worker"] for r in gw.log() if r.get("logger") == "llmesh.gateway.access"}


def test_the_queue_bound_holds_over_both_workers(gateway):
    refused: list[httpx.Response] = []
    codes = asyncio.run(_burst(gateway, 12, refused))
    # two run, four wait (over both workers together), the rest are refused. With a queue per worker
    # each worker bounds and releases on its own view (run that way: 5 answered, some refused by the
    # engine that both workers sent to at once)
    why = _refusals(gateway)
    assert codes.count(200) == SLOTS + MAX_QUEUED, (codes, why)
    assert codes.count(429) == 12 - SLOTS - MAX_QUEUED, (codes, why)
    for r in refused:  # OpenAI's shape, a reason the client can read, and when to come back
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full", error
        assert MODEL in error["message"]
        assert int(r.headers["retry-after"]) >= 1 and int(r.headers["retry-after-ms"]) >= 1
    assert _served_by(gateway) == {0, 1}
    assert gateway.metric("llmesh_flow_shared_fallback_total") == 0
    r = redis.Redis.from_url(gateway.service.env["LLMESH_REDIS_URL"])
    assert int(r.get(PREFIX + "n") or 0) == 0 and sum(int(v) for v in r.hvals(PREFIX + "inf")) == 0


def _owned(r: redis.Redis, pid: int) -> list[bytes]:
    """The entries a worker process holds in the shared queue (waiting or released)."""
    out = []
    for key in r.scan_iter(PREFIX + "e:*"):
        worker, status = r.hmget(key, "worker", "status")
        if worker and f":{pid}:" in worker.decode() and status in (b"queued", b"released"):
            out.append(key)
    return out


def test_a_killed_workers_queued_requests_leave_the_shared_queue(gateway):
    r = redis.Redis.from_url(gateway.service.env["LLMESH_REDIS_URL"])
    victim = gateway.ready_pids()[1]
    held: list[bytes] = []

    async def attempt() -> list[int] | None:
        """One burst; SIGKILL the victim once it holds an entry of it. None: the kernel gave this
        burst's every connection to the other worker (1 in 32 for six connections), so it ran whole."""
        burst = asyncio.ensure_future(_burst(gateway, SLOTS + MAX_QUEUED))
        while not burst.done():  # two hold the slots, four wait, spread over both workers
            await asyncio.sleep(0.05)
            held[:] = _owned(r, victim)
            if held:
                os.kill(victim, signal.SIGKILL)
                return await burst
        await burst
        return None

    for _ in range(6):
        codes = asyncio.run(attempt())
        if codes is not None:
            break
    assert held, "six bursts in a row went whole to the other worker"
    assert not pid_alive(victim)
    # the killed worker's connections broke (0); the other worker's requests were answered, or refused
    # with 429 when the kernel gave the victim enough connections to fill the shared queue
    assert set(codes) <= {0, 200, 429}, codes
    if {200, 429} & set(codes):  # the other worker took part, so it watches the model: with no new request,
        # its heartbeat's look drops the dead worker's entries once that worker's heartbeat lapsed (5 s)
        assert wait_until(lambda: not _owned(r, victim), 15), _owned(r, victim)
    # the slots the dead worker held serve again: a burst that fits them is answered whole (the calls
    # of its requests drop the dead worker's entries once its heartbeat has lapsed) ...
    assert asyncio.run(_burst(gateway, SLOTS)) == [200] * SLOTS
    # ... and nothing of the dead worker is left queued or held
    assert wait_until(lambda: not _owned(r, victim) and int(r.get(PREFIX + "n") or 0) == 0
                      and sum(int(v) for v in r.hvals(PREFIX + "inf")) == 0, 15), \
        (_owned(r, victim), r.get(PREFIX + "n"), r.hgetall(PREFIX + "inf"))
    alive = {w.decode() for w in r.zrange(PREFIX + "alive", 0, -1)}
    assert not any(f":{victim}:" in w for w in alive)

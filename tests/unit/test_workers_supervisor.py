"""The worker supervisor (llmesh.workers.Supervisor) over real, tiny worker processes:
start and readiness, restart with backoff and a budget, a graceful stop."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from llmesh.restarts import RestartPolicy
from llmesh.testing import pid_alive
from llmesh.workers import STOP_MARGIN_S, Supervisor, WorkersFailed, fresh_metrics_dir

# A worker as the supervisor starts it: argv ends with --worker I --ready-fd FD.
WORKER = r"""
import os, signal, sys, time
args = sys.argv[1:]
fd = int(args[args.index("--ready-fd") + 1])
mode = os.environ["MODE"]
if mode == "dies":
    sys.exit(3)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else (lambda *_: sys.exit(0)))
if mode != "slow":
    os.write(fd, b"r")
    os.close(fd)
if mode == "crashes":
    time.sleep(0.05)
    sys.exit(4)
while True:
    time.sleep(1)
"""

FAST = RestartPolicy(max_restarts=2, window_s=60, backoff_initial_s=0.01, backoff_max_s=0.05)


def supervisor(mode: str, count: int = 2, grace_s: float = 2, **kw) -> tuple[Supervisor, list[int], list[str]]:
    exits: list[int] = []
    restarts: list[str] = []
    sup = Supervisor([sys.executable, "-c", WORKER], count, {**os.environ, "MODE": mode}, grace_s=grace_s,
                     on_exit=exits.append, on_restart=lambda: restarts.append("r"), **kw)
    return sup, exits, restarts


async def test_starts_every_worker_and_stops_them_gracefully():
    sup, exits, _ = supervisor("serves", count=3)
    await sup.start()
    pids = sup.pids()
    assert len(pids) == 3 and all(pid_alive(p) for p in pids)
    assert await sup.stop() == [0, 0, 0]  # SIGTERM: each exits cleanly
    assert not [p for p in pids if pid_alive(p)]
    assert sorted(exits) == sorted(pids)  # every exit reported (metrics files of the dead dropped)


async def test_workers_that_die_before_they_serve_fail_the_start():
    sup, _, _ = supervisor("dies")
    with pytest.raises(WorkersFailed, match="2 of 2 workers did not start"):
        await sup.start()
    assert sup.pids() == []


async def test_a_worker_slower_than_the_ready_timeout_is_killed_and_fails_the_start():
    sup, _, _ = supervisor("slow", count=1, ready_timeout_s=0.5)
    with pytest.raises(WorkersFailed):
        await sup.start()
    assert sup.slots[0].proc.returncode == -signal.SIGKILL


async def test_a_killed_worker_is_restarted_in_its_slot():
    sup, exits, restarts = supervisor("serves", policy=FAST)
    await sup.start()
    victim, other = sup.slots[1].proc.pid, sup.slots[0].proc.pid
    os.kill(victim, signal.SIGKILL)
    for _ in range(200):
        if sup.slots[1].proc.pid != victim and sup.slots[1].proc.returncode is None and len(sup.slots[1].pids) == 2:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # the new process said it serves
    assert sup.slots[1].pids[0] == victim and pid_alive(sup.slots[1].proc.pid)
    assert sup.slots[0].proc.pid == other
    assert exits == [victim] and restarts == ["r"]
    assert not sup.failed.is_set()
    await sup.stop()


async def test_a_worker_that_keeps_crashing_spends_its_budget_and_fails_the_service():
    sup, exits, restarts = supervisor("crashes", count=1, policy=FAST)
    await sup.start()
    await asyncio.wait_for(sup.failed.wait(), 10)
    assert restarts == ["r", "r"]  # max_restarts, then it gives up
    assert len(exits) == 3 and sup.pids() == []
    await sup.stop()


async def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period():
    sup, exits, _ = supervisor("stubborn", count=1, grace_s=0.2)
    await sup.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await sup.stop() == [-signal.SIGKILL]
    assert 0.2 < loop.time() - t0 < 0.2 + STOP_MARGIN_S + 1


def test_each_run_gets_a_fresh_metrics_dir_and_those_of_dead_supervisors_go(tmp_path):
    import subprocess
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"llmesh-gateway-metrics-{dead.stdout.strip()}-abc"
    stale.mkdir()
    (stale / "counter_1.db").write_bytes(b"x")
    alive = tmp_path / f"llmesh-gateway-metrics-{os.getppid()}-def"  # a supervisor still running
    alive.mkdir()
    fresh = Path(fresh_metrics_dir("gateway", str(tmp_path)))
    assert fresh.name.startswith(f"llmesh-gateway-metrics-{os.getpid()}-") and not list(fresh.iterdir())
    assert not stale.exists() and alive.exists()

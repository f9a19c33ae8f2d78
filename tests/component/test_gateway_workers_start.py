"""`python -m llmesh.gateway --workers 2` refuses to start, with exit status 1 and a JSON
log line saying why, when it cannot run its workers correctly."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from llmesh.testing import free_ports


def gateway(tmp_path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    grpc_port, http_port, metrics_port = free_ports(3)
    base = {**os.environ, "LLMESH_STATE_DIR": str(tmp_path / "state"), "LLMESH_TRUST": "local",
            "LLMESH_CONFIG_BACKEND": "none", "LLMESH_GATEWAY_PORT": str(grpc_port),
            "LLMESH_GATEWAY_HTTP_PORT": str(http_port), "LLMESH_GATEWAY_METRICS_PORT": str(metrics_port),
            "LLMESH_GATEWAY_CACHE_ADDRESS": "", **env}
    return subprocess.run([sys.executable, "-m", "llmesh.gateway", *args], env=base, capture_output=True,
                          text=True, timeout=90, stdin=subprocess.DEVNULL)


def errors(done: subprocess.CompletedProcess) -> list[str]:
    lines = [json.loads(x) for x in done.stderr.splitlines() if x.startswith("{")]
    return [x.get("error", "") for x in lines if x["level"] == "error" and x["msg"] == "cannot start"]


def test_several_workers_without_redis_refuse_to_start(tmp_path):
    done = gateway(tmp_path, {"LLMESH_REDIS_URL": ""}, "--workers", "2")
    assert done.returncode == 1
    assert any("LLMESH_REDIS_URL" in e for e in errors(done)), done.stderr


def test_workers_that_cannot_bind_fail_the_gateway(tmp_path):
    (http_port,) = free_ports(1)
    with socket.socket() as taken:  # a plain listener (no SO_REUSEPORT) holds the HTTP port
        taken.bind(("127.0.0.1", http_port))
        taken.listen()
        done = gateway(tmp_path, {"LLMESH_GATEWAY_WORKERS": "2", "LLMESH_REDIS_URL": "redis://127.0.0.1:1/0",
                                  "LLMESH_GATEWAY_HTTP_PORT": str(http_port),
                                  "LLMESH_GATEWAY_BIND_WAIT_S": "1"})  # held for good: no use waiting long
    assert done.returncode == 1, done.stderr[-2000:]
    assert any("2 of 2 workers did not start" in e for e in errors(done)), done.stderr[-2000:]


def test_workers_never_share_their_port_with_another_process(tmp_path):
    """SO_REUSEPORT would let another of this user's processes (a second gateway with workers) listen
    beside the workers and take a share of their connections: the supervisor refuses to run so."""
    (grpc_port,) = free_ports(1)
    with socket.socket() as stranger:
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        stranger.bind(("127.0.0.1", grpc_port))
        stranger.listen()
        done = gateway(tmp_path, {"LLMESH_GATEWAY_WORKERS": "2", "LLMESH_REDIS_URL": "redis://127.0.0.1:1/0",
                                  "LLMESH_GATEWAY_PORT": str(grpc_port)})
    assert done.returncode == 1, done.stderr[-2000:]
    assert any(f"127.0.0.1:{grpc_port} is shared with pid {os.getpid()} (" in e for e in errors(done)), \
        done.stderr[-2000:]


async def test_several_workers_are_one_gateway_instance_in_etcd(etcd, redis_server, tmp_path):
    """The supervisor registers the gateway once, at its shared address; a worker's death and
    restart leave that registration alone; SIGTERM removes it."""
    import asyncio
    import uuid

    from llmesh.discovery.etcd import EtcdRegistry, etcd_client
    from llmesh.testing import Service, pid_alive

    grpc_port, http_port = free_ports(2)
    prefix = f"/workers-{uuid.uuid4().hex[:8]}"
    svc = Service("llmesh.gateway", {
        "LLMESH_GATEWAY_WORKERS": "2", "LLMESH_REDIS_URL": redis_server.url, "LLMESH_DISCOVERY": "etcd",
        "LLMESH_ETCD_ADDRESS": etcd.address, "LLMESH_DISCOVERY_PREFIX": prefix, "LLMESH_CONFIG_BACKEND": "none",
        "LLMESH_GATEWAY_PORT": str(grpc_port), "LLMESH_GATEWAY_HTTP_PORT": str(http_port),
        "LLMESH_GATEWAY_CACHE_ADDRESS": "", "LLMESH_GATEWAY_GRACE_S": "2"}, tmp_path / "gateway.log")
    registry = EtcdRegistry(etcd_client(etcd.address), prefix=prefix)

    def log() -> list[dict]:
        return [json.loads(x) for x in svc.log_path.read_text().splitlines() if x.startswith("{")]

    async def until(predicate, timeout_s: float = 30.0) -> bool:
        for _ in range(int(timeout_s / 0.1)):
            if await predicate():
                return True
            await asyncio.sleep(0.1)
        return False

    async def instances() -> list:
        return await registry.resolve("gateway")

    svc.start()
    try:
        assert await until(lambda: _one(instances)), svc.log_path.read_text()[-3000:]
        (gateway,) = await instances()
        assert gateway.address == f"127.0.0.1:{grpc_port}" and str(svc.proc.pid) in gateway.instance_id
        worker = next(r["pid"] for r in log() if r.get("msg") == "worker ready")
        os.kill(worker, 9)
        assert await until(lambda: _ready_again(log, worker)), svc.log_path.read_text()[-3000:]
        assert [i.instance_id for i in await instances()] == [gateway.instance_id]
        svc.proc.send_signal(15)
        assert await asyncio.to_thread(svc.proc.wait, 30) == 0
        assert await instances() == []  # deregistered on stop, not left to the lease
        assert not [r["pid"] for r in log() if r.get("msg") == "worker ready" and pid_alive(r["pid"])]
    finally:
        svc.stop()
        await registry.close()


async def _one(instances) -> bool:
    return len(await instances()) == 1


async def _ready_again(log, dead: int) -> bool:
    ready = [r for r in log() if r.get("msg") == "worker ready"]
    return len(ready) == 3 and ready[-1]["pid"] != dead


def test_the_workers_of_a_killed_supervisor_drain_and_exit_on_their_own(redis_server, tmp_path):
    """SIGKILL leaves the supervisor no time to stop its workers: the kernel sends each SIGTERM
    (PR_SET_PDEATHSIG), and each drains and exits within its grace period and the stop
    deadline; none is left running. Until then each counts the other's load ledger."""
    from llmesh.service import STOP_DEADLINE_MARGIN_S
    from llmesh.testing import Service, metric_values, pid_alive, wait_until

    grpc_port, http_port, metrics_port = free_ports(3)
    svc = Service("llmesh.gateway", {
        "LLMESH_GATEWAY_WORKERS": "2", "LLMESH_REDIS_URL": redis_server.url, "LLMESH_CONFIG_BACKEND": "none",
        "LLMESH_STATE_DIR": str(tmp_path / "state"), "LLMESH_TRUST": "local",
        "LLMESH_GATEWAY_PORT": str(grpc_port), "LLMESH_GATEWAY_HTTP_PORT": str(http_port),
        "LLMESH_GATEWAY_METRICS_PORT": str(metrics_port), "LLMESH_GATEWAY_CACHE_ADDRESS": "",
        "LLMESH_GATEWAY_GRACE_S": "2"}, tmp_path / "gateway.log")

    def log() -> list[dict]:
        return [json.loads(x) for x in svc.log_path.read_text().splitlines() if x.startswith("{")]

    def workers() -> list[int]:
        return [r["pid"] for r in log() if r.get("msg") == "worker ready"]

    svc.start()
    try:
        assert wait_until(lambda: len(workers()) == 2, 60), svc.log_path.read_text()[-3000:]
        pids = workers()
        # each worker counts the other's ledger (llmesh_ledger_peers, one series per worker)
        assert wait_until(lambda: metric_values(metrics_port, "llmesh_ledger_peers") == [1.0, 1.0], 10), \
            metric_values(metrics_port, "llmesh_ledger_peers")
        assert metric_values(metrics_port, "llmesh_ledger_share_failures_total") in ([], [0.0])
        svc.proc.kill()
        svc.proc.wait(10)
        assert wait_until(lambda: not any(pid_alive(p) for p in pids), 2 + STOP_DEADLINE_MARGIN_S + 5), \
            svc.log_path.read_text()[-3000:]
        stopped = [r for r in log() if r.get("msg") == "stopped" and r.get("logger") == "llmesh.service"]
        assert len(stopped) == 2 and "overran" not in svc.log_path.read_text(), svc.log_path.read_text()[-3000:]
    finally:
        svc.stop()
        for p in workers():
            if pid_alive(p):
                os.kill(p, 9)

"""A gateway run as two worker processes on one port (LLMESH_GATEWAY_WORKERS=2), in front
of a sim engine of a real mesh: both workers serve (each writes its own audit chain and
access log lines), the merged /metrics counts every request once, a killed worker is
restarted while the other keeps serving, and SIGTERM drains every worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from llmesh.audit import read_records, verify
from llmesh.testing import Mesh, Service, children_of, free_ports, free_layout, pid_alive, wait_until
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

MODEL = "sim-small"


@pytest.fixture(scope="module")
def sim_mesh(tmp_path_factory):
    d = tmp_path_factory.mktemp("workers-mesh")
    m = Mesh(layout=free_layout(n_engines=1), engines="sim", model_dir=d / "models", log_dir=d / "logs",
             env={"LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "10"}, args=["--no-cache"])
    m.start(timeout_s=90)
    yield m
    assert m.stop() == 0, m.logs()


class Gateway:
    """With Redis, credentials are required: ``key`` is a key of the Redis, whose tenant the
    config grants (a ``"*"`` tenant)."""

    def __init__(self, mesh: Mesh, redis_url: str, log_path: Path, key: str):
        self.grpc_port, self.http_port, self.metrics_port = free_ports(3)
        self.headers = {"authorization": f"Bearer {key}"}
        config = log_path.parent / "llmesh.yaml"
        config.write_text('tenants: {"*": {}}\n')
        lay = mesh.layout
        self.service = Service("llmesh.gateway", {
            "LLMESH_GATEWAY_WORKERS": "2", "LLMESH_REDIS_URL": redis_url,
            "LLMESH_GATEWAY_PORT": str(self.grpc_port), "LLMESH_GATEWAY_HTTP_PORT": str(self.http_port),
            "LLMESH_GATEWAY_METRICS_PORT": str(self.metrics_port), "LLMESH_GATEWAY_GRACE_S": "10",
            "LLMESH_GATEWAY_SCHEDULER_ADDRESS": lay.address("scheduler"),
            "LLMESH_GATEWAY_MODELMGR_ADDRESS": lay.address("modelmgr"), "LLMESH_GATEWAY_CACHE_ADDRESS": "",
            "LLMESH_CONFIG_BACKEND": "file", "LLMESH_CONFIG_FILE": str(config),
            "LLMESH_GATEWAY_BATCH_CLAIM_IDLE_S": "2"}, log_path)
        self.sent = 0
        self.redis_url = redis_url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def state_dir(self) -> Path:
        return self.service.log_path.parent / "state"

    def log(self) -> list[dict]:
        lines = self.service.log_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def ready_pids(self) -> dict[int, int]:
        """Worker index -> pid of its latest process that said it serves."""
        return {r["worker"]: r["pid"] for r in self.log() if r.get("msg") == "worker ready"}

    def chat(self, max_tokens: int = 4) -> None:
        """One request on a connection of its own (the kernel picks a worker per connection)."""
        with httpx.Client(timeout=20) as client:
            resp = client.post(self.url + "/v1/chat/completions", headers=self.headers, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})
        assert resp.status_code == 200, resp.text
        self.sent += 1

    def metric(self, name: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


@pytest.fixture(scope="module")
def gateway(sim_mesh, redis_server, tmp_path_factory):
    out = subprocess.run([sys.executable, "-m", "llmesh", "keys", "create", "--tenant", "workers", "--redis-url",
                          redis_server.url], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    gw = Gateway(sim_mesh, redis_server.url, tmp_path_factory.mktemp("gw") / "gateway.log",
                 out.stdout.strip().splitlines()[-1])
    gw.service.start()
    started = wait_until(lambda: any(r.get("msg") == "workers serving" for r in gw.log())
                         or gw.service.proc.poll() is not None, 60)
    assert started and gw.service.proc.poll() is None, gw.service.log_path.read_text()[-3000:]
    # the sim engine is routable once the scheduler's feed reached both workers
    assert wait_until(lambda: _models(gw) == [MODEL] * 8, 30), gw.service.log_path.read_text()[-3000:]
    yield gw
    gw.service.stop(signal.SIGKILL)


def _models(gw: Gateway) -> list[str]:
    out = []
    for _ in range(8):  # each on a connection of its own: both workers answer, most likely
        try:
            with httpx.Client(timeout=5) as client:
                out += [m["id"] for m in client.get(gw.url + "/v1/models", headers=gw.headers).json()["data"]]
        except (httpx.HTTPError, KeyError, ValueError):
            return []
    return out


def _ok_requests(gw: Gateway) -> float:
    return gw.metric("llmesh_requests_total")


def test_both_workers_serve_and_metrics_are_merged(gateway):
    supervisor = gateway.service.proc.pid
    workers = children_of(supervisor)
    assert sorted(workers) == sorted(gateway.ready_pids().values()) and len(workers) == 2
    for _ in range(40):
        gateway.chat()
    for _ in range(4):  # the gRPC port is shared too
        with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
            chunks = list(gateway_pb2_grpc.GatewayStub(channel).Chat(gateway_pb2.ChatRequest(
                model=MODEL, messages=[common_pb2.ChatMessage(role="user", content="hi")],
                sampling=common_pb2.SamplingParams(max_tokens=4)),
                timeout=20, metadata=tuple(gateway.headers.items())))
        assert chunks
        gateway.sent += 1
    # each worker wrote its own hash chain, and between them every request once
    assert wait_until(lambda: sum(len(list(read_records(f))) for f in _audit_files(gateway)) == gateway.sent, 10)
    files = _audit_files(gateway)
    assert [f.name for f in files] == ["audit.worker0.jsonl", "audit.worker1.jsonl"]
    assert all(len(list(read_records(f))) > 0 for f in files), "one worker served every request"
    assert all(verify(f).ok for f in files)
    served_by = {r["worker"] for r in gateway.log() if r.get("logger") == "llmesh.gateway.access"}
    assert served_by == {0, 1}
    # one /metrics for the gateway: the sum over the workers
    assert _ok_requests(gateway) == gateway.sent
    assert gateway.metric("llmesh_e2e_request_latency_seconds_count") == gateway.sent
    scrape = httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics",
                       headers={"Accept": "application/openmetrics-text"}, timeout=5)
    assert scrape.headers["content-type"].startswith("text/plain; version=0.0.4")  # classic text, always
    # the supervisor answers the service's /healthz: SERVING while its workers serve
    health = httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/healthz", timeout=5)
    assert (health.status_code, health.text) == (200, "SERVING\n")


def _audit_files(gw: Gateway) -> list[Path]:
    return sorted(gw.state_dir.glob("audit.worker*.jsonl"))


def test_a_killed_worker_is_restarted_and_the_gateway_keeps_serving(gateway):
    before = gateway.ready_pids()
    victim = before[1]
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(victim), 10)
    for _ in range(5):  # the other worker takes every new connection meanwhile
        gateway.chat()
    assert wait_until(lambda: gateway.ready_pids().get(1) not in (None, victim), 30), \
        gateway.service.log_path.read_text()[-3000:]
    after = gateway.ready_pids()
    assert after[0] == before[0] and sorted(children_of(gateway.service.proc.pid)) == sorted(after.values())
    exited = [r for r in gateway.log() if r.get("msg") == "worker exited; restarting it"]
    assert exited[-1]["pid"] == victim and exited[-1]["exit_code"] == -signal.SIGKILL
    for _ in range(10):
        gateway.chat()
    # the dead worker's counts still count; the restart is counted
    assert wait_until(lambda: _ok_requests(gateway) == gateway.sent, 5), (_ok_requests(gateway), gateway.sent)
    assert gateway.metric("llmesh_worker_restarts_total") == 1
    # the restarted worker continues its own chain
    assert verify(gateway.state_dir / "audit.worker1.jsonl").ok


def test_a_batch_completes_once_per_line_when_a_worker_process_is_killed_mid_batch(gateway):
    """Both workers take lines from the batch's Redis stream; SIGKILL one while lines run: the
    supervisor starts it again, the lines it held are claimed after the idle time, and the output
    holds every custom_id exactly once."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=gateway.headers["authorization"][7:],
                           max_retries=2)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "max_tokens": 60, "messages": [{"role": "user", "content": f"q{i}"}]}}
             for i in range(96)]
    upload = client.files.create(file=("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 8, 30)
    victim = gateway.ready_pids()[0]
    held = _stopped_holding_lines(victim, gateway.redis_url)
    os.kill(victim, signal.SIGKILL)
    assert held > 0
    assert wait_until(lambda: gateway.ready_pids().get(0) not in (None, victim), 30)
    assert wait_until(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"), 90)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts.completed == 96 and done.request_counts.failed == 0
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)  # each exactly once
    assert {x["response"]["status_code"] for x in out} == {200} and done.error_file_id is None
    # the dead worker's lines were claimed (a line it had recorded but not acknowledged may be claimed after the
    # batch completed: run again, recorded once) and none is left pending
    assert wait_until(lambda: any(r.get("msg") == "batch lines claimed" for r in gateway.log()), 15)
    assert wait_until(lambda: _pending(gateway.redis_url)["pending"] == 0, 15)


def _pending(redis_url: str) -> dict:
    client = redis.Redis.from_url(redis_url)
    try:
        return client.xpending("llmesh:batch:queue", "llmesh-batches")
    finally:
        client.close()


def _stopped_holding_lines(pid: int, redis_url: str) -> int:
    """Stops the worker (SIGSTOP) at a moment its consumer holds lines it took and has not acknowledged, and
    returns how many: the lines of a wave finish together, and a kill between the wave's acks and the next take
    would leave nothing to claim. The caller kills it."""
    for _ in range(200):
        os.kill(pid, signal.SIGSTOP)
        held = sum(c["pending"] for c in _pending(redis_url)["consumers"] if f":{pid}:" in c["name"].decode())
        if held:
            return held
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)
    return 0


def test_sigterm_drains_every_worker_and_stops(gateway):
    workers = children_of(gateway.service.proc.pid)
    assert len(workers) == 2
    metrics_dir = Path([r for r in gateway.log() if r.get("msg") == "workers serving"][-1]["metrics_dir"])
    assert metrics_dir.is_dir()
    n = 6
    answering = threading.Semaphore(0)
    results: list[tuple[str | None, bool]] = []  # (finish_reason, [DONE] seen) per stream
    stopped_at: list[float] = []
    ended_at: list[float] = []

    def stream() -> None:  # at 10 ms a token: still running when SIGTERM lands
        finish, done = None, False
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", gateway.url + "/v1/chat/completions", headers=gateway.headers, json={
                    "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
                    "stream": True}) as resp:
                for i, line in enumerate(resp.iter_lines()):
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        finish = json.loads(line[6:])["choices"][0].get("finish_reason") or finish
                        if i == 0:
                            answering.release()
        ended_at.append(time.monotonic())
        results.append((finish, done))

    threads = [threading.Thread(target=stream) for _ in range(n)]
    for t in threads:
        t.start()
    for _ in range(n):
        assert answering.acquire(timeout=15)
    stopped_at.append(time.monotonic())
    gateway.service.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    # every answer in flight at SIGTERM finished whole, after it
    assert results == [("length", True)] * n, results
    assert min(ended_at) > stopped_at[0]
    assert gateway.service.proc.wait(30) == 0
    assert not [p for p in workers if pid_alive(p)]
    log = gateway.log()
    assert [r["exit_codes"] for r in log if r.get("msg") == "workers stopped"] == [[0, 0]]
    assert sorted(r["worker"] for r in log if r.get("msg") == "stopped" and "worker" in r)[-2:] == [0, 1]
    assert not metrics_dir.exists()

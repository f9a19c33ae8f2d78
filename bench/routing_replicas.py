"""Issue 32's active-active check (``python -m bench.routing_replicas --json``): does a gateway of
several replicas route as well as one? A closed loop of multi-turn conversations on
``bench.routing_gateway``'s fleet (a mesh started as the README does, ``sim:4`` with a costly prefill, the
official ``openai`` client streaming over HTTP, ``prefix_aware`` routing, users for 80 % of the running slots),
through a gateway of 1 worker process and of 3 (``llmesh up --gateway-workers 3``: processes sharing
the ports, each with its own picker and load ledger, each fed the scheduler's KV-block stream; the
kernel gives each of the client's connections to one of them, so a conversation's turns cross
workers), and of 3 with one worker SIGKILLed halfway through (the gateway's supervisor restarts it).
The workers share their in-flight load through the Redis (``LLMESH_GATEWAY_LEDGER_SHARE_S``); a
fourth run of 3 workers with that off shows what the sharing does. Each on a fresh mesh, with a
Redis (several workers need one) and an API key.

Per run: the engines' KV hit rate (their prefix-cache hit tokens over the prompt tokens they were
asked for), follow-ups served on their previous turn's engine, TTFT p50/p99, and the requests that
failed at the client (the official client's two retries on, as an application runs it: a request
whose connection broke before its answer began is retried, a stream cut by the kill is not). Goal
(issue 32): the hit rate with 3 replicas, and with one of them killed, >= 95 % of one replica's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from openai import OpenAI

from bench.common import note
from bench.conversation_load import MODEL, Turn, conversation_loop
from bench.routing_gateway import Plan, attach_endpoints, fleet, plan_from_args, served_by, sim_env, summarize
from llmesh.testing import Mesh, RedisServer, free_layout, metric_values, wait_until

GOAL = 0.95
# name, gateway workers, one of them killed halfway, in-flight load shared over Redis
RUNS = (("one", 1, False, True), ("three", 3, False, True), ("three_one_killed", 3, True, True),
        ("three_unshared", 3, False, False))


def prefix_totals(mesh: Mesh) -> tuple[float, float]:
    """(prefix-cache hit tokens, queried tokens) summed over the engines."""
    ports = [port for name, port in mesh.metrics_ports().items() if name.startswith("engine")]
    hits = sum(sum(metric_values(p, "vllm:prefix_cache_hits_total")) for p in ports)
    queries = sum(sum(metric_values(p, "vllm:prefix_cache_queries_total")) for p in ports)
    return hits, queries


def workers_ready(mesh: Mesh) -> dict[int, int]:
    """The gateway's worker index -> the pid of its latest process that said it serves."""
    out: dict[int, int] = {}
    for line in (mesh.log_dir / "gateway.log").read_text().splitlines():
        if '"worker ready"' in line:
            record = json.loads(line)
            out[record["worker"]] = record["pid"]
    return out


def users(client: OpenAI, plan: Plan, stop_at: float, out: list[Turn], errors: list[str]) -> list[threading.Thread]:
    """``plan.conversations`` closed-loop users (bench.routing_gateway's capacity loop), each counting the
    requests that failed at the client and starting a new conversation after one."""
    closed = plan.users(plan.conversations)
    return [threading.Thread(target=conversation_loop, args=(client, closed, w, stop_at, None, out, errors))
            for w in range(closed.count)]


def start_mesh(root: Path, plan: Plan, workers: int, redis_url: str, share: bool) -> Mesh:
    config = root / "llmesh.yaml"
    config.write_text(f'tenants: {{"bench": {{}}}}\nmodels: {{{MODEL}: {{routing: prefix_aware}}}}\n')
    mesh = Mesh(layout=free_layout(n_engines=plan.engines), engines=f"sim:{plan.engines}",
                model_dir=root / "models", log_dir=root / "logs",
                args=["--no-cache", "--gateway-workers", str(workers)],
                env={"LLMESH_CONFIG_FILE": str(config), "LLMESH_REDIS_URL": redis_url, **sim_env(plan),
                     **({} if share else {"LLMESH_GATEWAY_LEDGER_SHARE_S": "0"})})
    mesh.start(timeout_s=120)
    if workers > 1 and not wait_until(lambda: len(workers_ready(mesh)) == workers, 60):  # one: no supervisor
        mesh.stop()
        raise RuntimeError(f"{workers} gateway workers did not all start:\n" + mesh.logs())
    return mesh


def run(plan: Plan, name: str, workers: int, kill: bool, share: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmesh-bench-replicas-") as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        try:
            key = subprocess.run([sys.executable, "-m", "llmesh", "keys", "create", "--tenant", "bench", "--redis-url",
                                  redis.url], capture_output=True, text=True, check=True,
                                 stdin=subprocess.DEVNULL).stdout.strip().splitlines()[-1]
            mesh = start_mesh(Path(tmp), plan, workers, redis.url, share)
            try:
                return {**measure(mesh, plan, name, workers, kill, key), "load_shared": share}
            finally:
                mesh.stop()
        finally:
            redis.stop()


def measure(mesh: Mesh, plan: Plan, name: str, workers: int, kill: bool, key: str) -> dict:
    client = OpenAI(base_url=mesh.layout.http_url + "/v1", api_key=key, timeout=60)  # the SDK's 2 retries
    note(f"routing_replicas: {name}: {workers} worker(s), {plan.conversations} conversations, {plan.duration_s:.0f} s")
    out: list[Turn] = []
    errors: list[str] = []
    before = prefix_totals(mesh)
    started = time.monotonic()
    threads = users(client, plan, started + plan.duration_s, out, errors)
    for t in threads:
        t.start()
    killed = None
    if kill:
        time.sleep(plan.duration_s / 2)
        killed = workers_ready(mesh)[1]
        os.kill(killed, signal.SIGKILL)
    for t in threads:
        t.join()
    hits, queries = (b - a for a, b in zip(before, prefix_totals(mesh)))
    attach_endpoints(out, mesh.log_dir / "gateway.log")
    records = served_by(mesh.log_dir / "gateway.log")
    per_worker = Counter(str(records[t.rid].get("worker", 0)) for t in out if t.rid in records)
    # its supervisor restarts it within seconds (a worker's start: imports, the first table); a short run may end sooner
    restarted = kill and wait_until(lambda: workers_ready(mesh).get(1) not in (None, killed), 30)
    return {"workers": workers, "killed_worker": killed is not None, "killed_worker_restarted": restarted,
            "kv_hit_rate": round(hits / queries, 3) if queries else None, "requests": len(out),
            "client_errors": len(errors), "client_error_kinds": sorted(set(errors)),
            "turns_per_worker": dict(sorted(per_worker.items())), **summarize(out)}


def main(argv: list[str] | None = None) -> None:
    plan = plan_from_args("python -m bench.routing_replicas", __doc__.split("\n")[0], argv, "run")
    runs = {name: run(plan, name, workers, kill, share) for name, workers, kill, share in RUNS}
    one = runs["one"]["kv_hit_rate"]
    ratios = {name: round(r["kv_hit_rate"] / one, 3) if one and r["kv_hit_rate"] is not None else None
              for name, r in runs.items() if name != "one" and r["load_shared"]}
    print(json.dumps({"bench": "routing_replicas", "model": MODEL, "fleet": fleet(plan),
                      "conversations": plan.conversations,
                      "duration_s": plan.duration_s, "runs": runs, "hit_rate_vs_one": ratios,
                      "follow_ups_on_prefix_engine_vs_one": {
                          name: round(r["follow_up_prefix_hit_rate"] / runs["one"]["follow_up_prefix_hit_rate"], 3)
                          if runs["one"]["follow_up_prefix_hit_rate"] and r["follow_up_prefix_hit_rate"] is not None
                          else None for name, r in runs.items() if name != "one"}, "goal": GOAL,
                      "goal_met": all(x is not None and x >= GOAL for x in ratios.values())}, indent=2))


if __name__ == "__main__":
    main()

"""What governance costs a request: two gateway processes behind one sim engine
(0 ms per token), one with governance off (local mode, no limits, no guards, no
audit) and one with all of it on (an API key checked against Redis, RPM + TPM +
concurrency + budget in one Lua call, PII masking and restoring, the injection
screen, usage, the audit log). Same requests, interleaved rounds, one
connection: gateway CPU per request and p50 latency, and their differences.

    python -m bench.governance [--requests 400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmesh.testing import Mesh, RedisServer, Service, free_layout, free_ports, wait_until
from bench.common import cpu_seconds, note, pct

MODEL = "sim-small"
PROMPT = ("Please write to jane.doe@example.com and call +1 415 555 0100 about order 88231; "
          "summarise the attached notes in two sentences.")
CONFIG = {
    "tenants": {
        "default": {"guards": {"pii": "off", "output_pii": "off", "injection": "off"}},
        "gov": {"models": [MODEL], "max_tokens": 64, "priority": "normal",
                "budget": {"tokens": 10_000_000_000, "period": "day"},
                "guards": {"pii": "mask", "restore": True, "output_pii": "mask", "injection": "flag"}},
    },
    "rate_limits": {"gov": {"requests_per_minute": 1_000_000, "tokens_per_minute": 1_000_000_000,
                            "max_concurrency": 1000}},
    "prices": {MODEL: {"input_per_1k": 0.1, "output_per_1k": 0.2}},
}


def one_round(client: httpx.Client, url: str, key: str, n: int) -> list[float]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 0.7}
    times = []
    for _ in range(n):
        start = time.perf_counter()
        r = client.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
        times.append(time.perf_counter() - start)
        r.raise_for_status()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="per gateway per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="llmesh-bench-gov-"))
    redis = RedisServer(root / "redis")
    redis.start()
    (root / "llmesh.yaml").write_text(json.dumps(CONFIG))
    layout = free_layout(n_engines=1)
    base = {"LLMESH_CONFIG_FILE": str(root / "llmesh.yaml"), "LLMESH_STATE_DIR": str(root / "state")}
    mesh = Mesh(layout=layout, engines="sim", model_dir=root / "models", log_dir=root / "logs",
                env={**base, "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "0", "LLMESH_GATEWAY_AUDIT": "false"},
                args=["--no-cache"])
    mesh.start()
    gateways: dict[str, tuple[Service, str]] = {}
    try:
        for name, extra in (("off", {"LLMESH_GATEWAY_KEYS_FILE": str(root / "none.json"),
                                     "LLMESH_GATEWAY_AUDIT": "false"}),
                            ("on", {"LLMESH_REDIS_URL": redis.url,
                                    "LLMESH_GATEWAY_AUDIT_FILE": str(root / "audit.jsonl")})):
            grpc_port, http_port = free_ports(2)
            svc = Service("llmesh.gateway", {
                **base, **extra, "LLMESH_GATEWAY_PORT": str(grpc_port), "LLMESH_GATEWAY_HTTP_PORT": str(http_port),
                "LLMESH_GATEWAY_SCHEDULER_ADDRESS": layout.address("scheduler"),
                "LLMESH_GATEWAY_MODELMGR_ADDRESS": layout.address("modelmgr"), "LLMESH_GATEWAY_CACHE_ADDRESS": ""},
                root / f"gateway-{name}.log")
            svc.start()
            gateways[name] = (svc, f"http://127.0.0.1:{http_port}")
        out = subprocess.run([sys.executable, "-m", "llmesh", "keys", "create", "--tenant", "gov",
                              "--redis-url", redis.url], capture_output=True, text=True, check=True)
        keys = {"off": "none", "on": out.stdout.strip().splitlines()[-1]}
        with httpx.Client(timeout=30) as client:
            for name, (_, url) in gateways.items():
                if not wait_until(lambda: _serves(client, url, keys[name]), 60):
                    raise RuntimeError(f"gateway {name} did not serve")
                one_round(client, url, keys[name], 50)  # warm up
            lat = {name: [] for name in gateways}
            cpu = {name: 0.0 for name in gateways}
            for _ in range(args.rounds):
                for name, (svc, url) in gateways.items():
                    before = cpu_seconds(svc.proc.pid)
                    lat[name] += one_round(client, url, keys[name], args.requests)
                    cpu[name] += cpu_seconds(svc.proc.pid) - before
        n = args.requests * args.rounds
        result = {name: {"requests": n, "gateway_cpu_ms_per_request": round(cpu[name] / n * 1000, 3),
                         "p50_ms": round(statistics.median(lat[name]) * 1000, 3),
                         "p99_ms": round(pct(lat[name], 99) * 1000, 3)} for name in gateways}
        result["added"] = {
            "cpu_ms_per_request": round(result["on"]["gateway_cpu_ms_per_request"]
                                        - result["off"]["gateway_cpu_ms_per_request"], 3),
            "p50_ms": round(result["on"]["p50_ms"] - result["off"]["p50_ms"], 3)}
        result["note"] = ("CPU from /proc at 10 ms resolution over every request of a gateway; one connection, "
                          "non-streamed, 8 tokens, sim engine at 0 ms per token")
        print(json.dumps(result, indent=1))
    finally:
        for svc, _ in gateways.values():
            svc.stop()
        mesh.stop()
        redis.stop()


def _serves(client: httpx.Client, url: str, key: str) -> bool:
    try:
        one_round(client, url, key, 1)
        return True
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    note("bench.governance: starting a sim mesh, Redis and two gateways")
    main()

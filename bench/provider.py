"""The gateway in front of any OpenAI-compatible server: the same chat requests sent
straight to an instant server (bench.instant_openai) and through the gateway, which
has it as a provider upstream; non-streamed and streamed (32 chunks), at 1 and 32
connections: requests/s, added p50 latency, gateway CPU per request. Then the hot
path with circuit breakers and the retry budget on vs off (live config).

    python -m bench.provider [--requests 300] [--chunks 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
import time
from pathlib import Path

import httpx

from llmesh.testing import Mesh, free_layout
from bench import instant_openai
from bench.common import Sample, child_pid, cpu_seconds, drive, note, sse_call

MODEL = "hosted"


CONFIG = "llmesh.yaml"


def config(base_url: str, resilience: bool) -> str:
    doc = {"providers": {"instant": {"base_url": base_url, "models": {MODEL: "instant"}}},
           "circuit_breaker": {"enabled": resilience},
           "retry_budget": {"ratio": 0.2 if resilience else 0.0, "burst": 10 if resilience else 0}}
    return json.dumps(doc)  # JSON is YAML


def mesh(base_url: str, tmp: Path, args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Mesh:
    """A mesh (not yet started) whose gateway routes MODEL to the provider at ``base_url``,
    breakers and retry budget on, logs quiet; ``tmp`` holds its config (CONFIG, live: a
    rewrite is applied), models and logs."""
    cfg = tmp / CONFIG
    cfg.write_text(config(base_url, True))
    return Mesh(layout=free_layout(1), engines="sim", model_dir=tmp / "models", log_dir=tmp / "logs", args=list(args),
                env={"LLMESH_CONFIG_FILE": str(cfg), "LLMESH_GATEWAY_LOG_LEVEL": "warning",
                     "LLMESH_ENGINE_LOG_LEVEL": "warning", **(env or {})})


async def call(client: httpx.AsyncClient, url: str, stream: bool) -> Sample:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 64, "stream": stream}
    if stream:
        return await sse_call(client, url, body)  # counts chunks: no usage chunk asked for
    start = time.perf_counter()
    resp = await client.post(url, json=body)
    resp.raise_for_status()
    total = time.perf_counter() - start
    return Sample(total, total, resp.json()["usage"]["completion_tokens"])


async def measure(direct: str, gateway: str, gw_pid: int, requests: int, levels: list[int]) -> dict:
    out = {}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=256)) as client:
        for stream in (False, True):
            for level in levels:
                row = {}
                for name, url in (("direct", direct), ("gateway", gateway)):
                    await drive(lambda i: call(client, url, stream), level, 20)  # warm
                    cpu0 = cpu_seconds(gw_pid)
                    r = await drive(lambda i: call(client, url, stream), level, requests)
                    r["requests_per_s"] = round(r["requests"] / r["wall_s"], 1)
                    cpu_ms = (cpu_seconds(gw_pid) - cpu0) * 1000
                    r["gateway_cpu_ms_per_request"] = round(cpu_ms / max(r["requests"], 1), 3)
                    row[name] = r
                row["gateway"]["added_ms_p50"] = round(row["gateway"]["ttft_ms_p50"] - row["direct"]["ttft_ms_p50"], 3)
                key = f"{'stream' if stream else 'plain'}_c{level}"
                out[key] = row
                note(f"{key:<10} direct {row['direct']['requests_per_s']:.0f} req/s, gateway "
                     f"{row['gateway']['requests_per_s']:.0f} req/s, "
                     f"added p50 {row['gateway']['added_ms_p50']:.2f} ms, "
                     f"gateway CPU {row['gateway']['gateway_cpu_ms_per_request']:.2f} ms/req")
    return out


async def overhead(gateway: str, gw_pid: int, requests: int, cfg_path: Path, base_url: str) -> dict:
    out = {}
    async with httpx.AsyncClient(timeout=60) as client:
        for on in (False, True, False, True):  # alternated, twice, against drift
            cfg_path.write_text(config(base_url, on))
            await asyncio.sleep(2.0)  # the live config applies within a second
            cpu0 = cpu_seconds(gw_pid)
            r = await drive(lambda i: call(client, gateway, True), 1, requests)
            r["gateway_cpu_ms_per_request"] = round((cpu_seconds(gw_pid) - cpu0) * 1000 / max(r["requests"], 1), 3)
            out.setdefault("on" if on else "off", []).append(
                {k: r[k] for k in ("ttft_ms_p50", "ttft_ms_p99", "gateway_cpu_ms_per_request", "errors")})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--levels", default="1,32")
    args = parser.parse_args()
    with instant_openai.running(args.chunks) as base_url, tempfile.TemporaryDirectory() as tmp:
        running = mesh(base_url, Path(tmp))
        running.start(timeout_s=60)
        try:
            gw_pid = child_pid(running.proc.pid, "llmesh.gateway")
            gateway = running.layout.http_url + "/v1/chat/completions"
            levels = [int(x) for x in args.levels.split(",")]
            results = asyncio.run(measure(base_url + "/chat/completions", gateway, gw_pid, args.requests, levels))
            results["resilience_on_vs_off_stream_c1"] = asyncio.run(
                overhead(gateway, gw_pid, args.requests, Path(tmp) / CONFIG, base_url))
        finally:
            running.stop(signal.SIGINT)
    print(json.dumps({"bench": "provider", "chunks": args.chunks, "results": results}, indent=2))


if __name__ == "__main__":
    main()

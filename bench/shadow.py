"""Shadow traffic's cost on the hot path: chat requests through the gateway to an
instant OpenAI-compatible server (a provider upstream), with every request copied to
a shadow model (the same server under another name) vs no shadow section (live
config, alternated twice against drift), and with 10 % of requests copied. Per mode: the primary's p50/p99 latency
(time to first token when streamed) at 1 connection, and the gateway's CPU per
request, which includes the copy's own work. Then 32 connections with
``max_concurrency`` copies at most: how many copies were dropped (shed first). First,
in process: what the shadow and cascade stages cost a request when the live config
has no section for its model (admit + finish of both, microseconds).

    python -m bench.shadow [--requests 300] [--chunks 32] [--max-concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
from pathlib import Path

import httpx

from llmesh.shadow import FileShadowStore
from llmesh.testing import Mesh, free_layout
from bench import instant_openai
from bench.common import child_pid, cpu_seconds, drive, note
from bench.provider import MODEL, call

SHADOW = "hosted-shadow"


def config(base_url: str, sample: float, max_concurrency: int) -> str:
    """``sample`` 0: no shadow section."""
    doc = {"providers": {"instant": {"base_url": base_url, "models": {MODEL: "instant", SHADOW: "instant-2"}}}}
    if sample:
        doc["shadows"] = {MODEL: {"model": SHADOW, "sample": sample, "max_concurrency": max_concurrency}}
    return json.dumps(doc)  # JSON is YAML


async def run_mode(client: httpx.AsyncClient, gateway: str, gw_pid: int, stream: bool, level: int,
                   requests: int) -> dict:
    await drive(lambda i: call(client, gateway, stream), level, 20)  # warm
    cpu0 = cpu_seconds(gw_pid)
    r = await drive(lambda i: call(client, gateway, stream), level, requests)
    await asyncio.sleep(0.5)  # copies still in flight finish on the gateway's CPU: count them
    r["gateway_cpu_ms_per_request"] = round((cpu_seconds(gw_pid) - cpu0) * 1000 / max(r["requests"], 1), 3)
    return {k: r[k] for k in ("requests", "errors", "ttft_ms_p50", "ttft_ms_p99", "gateway_cpu_ms_per_request")}


async def measure(gateway: str, gw_pid: int, requests: int, cfg: Path, base_url: str, max_concurrency: int,
                  store: FileShadowStore) -> dict:
    out: dict = {}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
        for stream in (False, True):
            key = f"{'stream' if stream else 'plain'}_c1"
            for sample in (0, 1.0, 0.1) * 2:  # alternated, twice, against drift
                cfg.write_text(config(base_url, sample, max_concurrency))
                await asyncio.sleep(2.0)  # the live config applies within a second
                row = await run_mode(client, gateway, gw_pid, stream, 1, requests)
                mode = f"on_sample_{sample}" if sample else "off"
                out.setdefault(key, {}).setdefault(mode, []).append(row)
                note(f"{key} shadow {mode}: p50 {row['ttft_ms_p50']:.2f} ms, p99 "
                     f"{row['ttft_ms_p99']:.2f} ms, gateway CPU {row['gateway_cpu_ms_per_request']:.2f} ms/req")
        before = await store.read(MODEL)
        cfg.write_text(config(base_url, 1.0, max_concurrency))
        await asyncio.sleep(2.0)
        row = await run_mode(client, gateway, gw_pid, False, 32, requests)
    await asyncio.sleep(1.5)  # drop counts reach the store within a second
    after = await store.read(MODEL)
    row["copies_recorded"] = len(after[0]) - len(before[0])
    row["copies_dropped"] = after[1] - before[1]
    out["plain_c32_shadow_on"] = row
    note(f"plain_c32 shadow on: {row['copies_recorded']} copies recorded, {row['copies_dropped']} dropped "
         f"(max_concurrency {max_concurrency}), p50 {row['ttft_ms_p50']:.2f} ms")
    records = after[0]
    out["recorded_total"] = len(records)
    return out


async def stages_off_us(n: int = 20000) -> dict:
    """Admit + finish of the cascade and shadow stages for a model with neither section."""
    import time

    from prometheus_client import CollectorRegistry
    from llmesh.liveconfig.schema import MeshConfig
    from llmesh.types import Message, Prompt, Sampling
    from llmesh.gateway.context import CompletionRequest, Context
    from llmesh.gateway.stages.cascade import CascadeMetrics, CascadeStage
    from llmesh.gateway.stages.shadow import ShadowMetrics, ShadowStage

    config = MeshConfig.model_validate({"shadows": {"other": {"model": "b"}},
                                        "cascades": {"smart": {"cheap": "a", "strong": "b", "min_confidence": -1}}})
    registry = CollectorRegistry()
    stages = [CascadeStage(lambda: config, CascadeMetrics(registry)),
              ShadowStage(lambda: config, FileShadowStore(Path("/nonexistent")), ShadowMetrics(registry))]
    req = CompletionRequest(request_id="r", tenant="t", model=MODEL, timeout_s=10,
                            prompt=Prompt(messages=(Message("user", "hi"),)), sampling=Sampling())
    ctx = Context(req, {"status": "ok"}, None, asked=MODEL)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            for stage in stages:
                await stage.admit(ctx)
            for stage in reversed(stages):
                await stage.finish(ctx)
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return {"stages_off_us_per_request": round(best, 3), "repeats": 5, "requests_each": n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=4)
    args = parser.parse_args()
    in_process = asyncio.run(stages_off_us())
    note(f"stages off: {in_process['stages_off_us_per_request']:.2f} us per request")
    with instant_openai.running(args.chunks) as base_url, tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "llmesh.yaml"
        cfg.write_text(config(base_url, 0, args.max_concurrency))
        logs = Path(tmp) / "logs"
        mesh = Mesh(layout=free_layout(1), engines="sim", model_dir=Path(tmp) / "models", log_dir=logs,
                    env={"LLMESH_CONFIG_FILE": str(cfg), "LLMESH_GATEWAY_LOG_LEVEL": "warning",
                         "LLMESH_ENGINE_LOG_LEVEL": "warning"})
        mesh.start(timeout_s=60)
        try:
            gw_pid = child_pid(mesh.proc.pid, "llmesh.gateway")
            results = asyncio.run(measure(mesh.layout.http_url + "/v1/chat/completions", gw_pid, args.requests,
                                          cfg, base_url, args.max_concurrency,
                                          FileShadowStore(logs / "state" / "shadow")))
        finally:
            mesh.stop(signal.SIGINT)
    results["in_process"] = in_process
    print(json.dumps({"bench": "shadow", "chunks": args.chunks, "results": results}, indent=2))


if __name__ == "__main__":
    main()

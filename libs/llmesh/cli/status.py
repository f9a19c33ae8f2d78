"""``llmesh status``: ask each service of a running mesh how it is."""

from __future__ import annotations

import asyncio
import os

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.health import health_status
from llmesh.rpc.identity import Identity
from llmesh.v1 import modelmgr_pb2, modelmgr_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from llmesh.cli.layout import Layout

SERVICES = ("gateway", "scheduler", "modelmgr", "cache")


async def _endpoints(address: str, identity: Identity | None) -> list[dict[str, Any]]:
    async with mesh_channel(address, "scheduler", identity) as ch:
        try:
            table = await scheduler_pb2_grpc.SchedulerStub(ch).ListEndpoints(
                scheduler_pb2.ListEndpointsRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return []
    return [{"endpoint_id": e.endpoint_id, "address": e.address, "backend": e.backend,
             "models": list(e.models), "healthy": e.healthy, "degraded": e.degraded, "running": e.load.running,
             "waiting": e.load.waiting, "max_running": e.load.max_running, "kv_blocks": e.kv_blocks,
             "last_report_age_s": e.last_report_age_s,
             "hardware": {"cpu_model": e.hardware.cpu_model, "cpu_cores": e.hardware.cpu_cores,
                          "memory_total_bytes": e.hardware.memory_total_bytes,
                          "gpus": [{"name": g.name, "memory_total_bytes": g.memory_total_bytes,
                                    "ecc_errors_uncorrected": g.ecc_errors_uncorrected} for g in e.hardware.gpus]},
             "self_test": {"ok": e.self_test.ok, "detail": e.self_test.detail,
                           "latency_ms": round(e.self_test.latency_ms, 1)}} for e in table.endpoints]


async def _models(address: str, identity: Identity | None) -> list[dict[str, Any]]:
    async with mesh_channel(address, "modelmgr", identity) as ch:
        try:
            resp = await modelmgr_pb2_grpc.ModelManagerStub(ch).ListModels(
                modelmgr_pb2.ListModelsRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return []
    return [{"name": m.name, "format": m.format, "size_bytes": m.size_bytes, "sha256": m.sha256,
             "context_length": m.context_length, "source": m.source} for m in resp.models]


def _samples(text: str) -> list[Any]:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


async def _scrape(port: int) -> list[Any]:
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            return _samples((await http.get(f"http://127.0.0.1:{port}/metrics")).text)
    except httpx.HTTPError:
        return []


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """histogram_quantile over cumulative bucket counts {le: count}."""
    if not buckets or not buckets.get(math.inf):
        return None
    total, prev_le, prev_count = buckets[math.inf], 0.0, 0.0
    for le in sorted(buckets):
        if buckets[le] >= q * total:
            if le == math.inf:
                return prev_le
            span = buckets[le] - prev_count
            return prev_le + (le - prev_le) * ((q * total - prev_count) / span if span else 0)
        prev_le, prev_count = le, buckets[le]
    return None


async def live_figures(layout: Layout, endpoints: list[dict[str, Any]], window_s: float = 1.0) -> dict[str, Any]:
    """Requests per second over ``window_s``, gateway TTFT quantiles since start,
    and each engine's queue and KV-cache use."""
    port = layout.metrics_port("gateway")
    first = await _scrape(port)
    await asyncio.sleep(window_s)
    second = await _scrape(port)

    def count(samples: list[Any]) -> float:
        total: float = sum(s.value for s in samples if s.name == "llmesh_requests_total")
        return total

    buckets: dict[float, float] = {}
    for s in second:
        if s.name == "llmesh_time_to_first_token_seconds_bucket":
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
    p50, p99 = quantile(0.5, buckets), quantile(0.99, buckets)
    engines = []
    for e in endpoints:
        kv = None
        if e["endpoint_id"].startswith("engine-") and e["endpoint_id"][7:].isdigit():
            samples = await _scrape(layout.metrics_port(e["endpoint_id"]))
            kv = next((s.value for s in samples if s.name == "vllm:kv_cache_usage_perc"), None)
        engines.append({"endpoint_id": e["endpoint_id"], "running": e["running"], "waiting": e["waiting"],
                        "kv_cache_usage": kv, "kv_blocks": e["kv_blocks"]})
    return {"requests_per_s": round((count(second) - count(first)) / window_s, 2) if second else None,
            "requests_total": count(second) if second else None,
            "ttft_ms_p50": round(p50 * 1000, 1) if p50 is not None else None,
            "ttft_ms_p99": round(p99 * 1000, 1) if p99 is not None else None,
            "engines": engines}


def supervised(state_path: Path | None) -> dict[str, dict[str, Any]]:
    """Per process of a running ``llmesh up`` (its supervisor.json): pid, restarts, last exit code."""
    try:
        state = orjson.loads(state_path.read_bytes()) if state_path else None
    except (OSError, orjson.JSONDecodeError):
        return {}
    if not state or not _pid_alive(state.get("supervisor_pid", 0)):
        return {}
    return {c["name"]: c for c in state["children"]}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError, OverflowError):
        return False
    return pid > 0


async def collect(layout: Layout, state_path: Path | None = None, identity: Identity | None = None) -> dict[str, Any]:
    """``identity``: the cli's, to ask a mesh that requires one (LLMESH_TRUST=tls or token)."""
    addresses = {s: layout.address(s) for s in SERVICES}
    health = await asyncio.gather(*(health_status(a, identity=identity, target_service=s)
                                    for s, a in addresses.items()))
    endpoints, models = await asyncio.gather(_endpoints(addresses["scheduler"], identity),
                                             _models(addresses["modelmgr"], identity))
    services: list[dict[str, Any]] = [{"name": s, "address": a, "health": h}
                                      for (s, a), h in zip(addresses.items(), health)]
    services += [{"name": e["endpoint_id"], "address": e["address"], "health": await health_status(
                     e["address"], identity=identity, target_service="engine")}
                 for e in endpoints]
    procs = supervised(state_path)
    for s in services:
        proc = procs.get(s["name"])
        proc = proc if proc and proc["address"] == s["address"] else None  # another mesh's supervisor
        s["restarts"] = proc["restarts"] if proc else None
        s["last_exit_code"] = proc["last_exit_code"] if proc else None
    return {"gateway_http": layout.http_url, "services": services, "endpoints": endpoints, "models": models,
            "live": await live_figures(layout, endpoints)}


def render(report: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return orjson.dumps(report, option=orjson.OPT_INDENT_2).decode()
    lines = [f"gateway HTTP  {report['gateway_http']}", "",
             "SERVICE            ADDRESS              HEALTH       RESTARTS"]
    lines += [f"{s['name']:<18} {s['address']:<20} {s['health']:<12} "
              f"{'-' if s['restarts'] is None else s['restarts']}"
              + ("" if s["last_exit_code"] is None else f" (last exit {s['last_exit_code']})")
              for s in report["services"]]
    lines += ["", "ENDPOINT           BACKEND   MODELS                    RUNNING WAITING HEALTHY"]
    lines += [f"{e['endpoint_id']:<18} {e['backend']:<9} {','.join(e['models']):<25} "
              f"{e['running']:>7} {e['waiting']:>7} {'yes' if e['healthy'] else 'no'}" for e in report["endpoints"]]
    lines += [f"  {e['endpoint_id']:<16} DEGRADED, no new work: {e['degraded']}"
              for e in report["endpoints"] if e["degraded"]]
    live = report["live"]
    fmt: Callable[..., str] = lambda v, unit="": "-" if v is None else f"{v}{unit}"  # noqa: E731
    lines += ["", f"LIVE  {fmt(live['requests_per_s'])} req/s ({fmt(live['requests_total'])} total)  "
              f"TTFT p50 {fmt(live['ttft_ms_p50'], ' ms')}  p99 {fmt(live['ttft_ms_p99'], ' ms')} (since start)"]
    for e in live["engines"]:
        kv = "-" if e["kv_cache_usage"] is None else f"{e['kv_cache_usage']:.1%}"
        lines.append(f"  {e['endpoint_id']:<16} queue {e['running']} running / {e['waiting']} waiting   "
                     f"KV {kv} in use, {e['kv_blocks']} blocks cached")
    for e in report["endpoints"]:
        hw, st = e["hardware"], e["self_test"]
        gpus = ", ".join(g["name"] for g in hw["gpus"]) or "no GPU"
        test = "self-test ok" if st["ok"] else f"self-test FAILED: {st['detail']}"
        lines.append(f"  {e['endpoint_id']:<16} {hw['cpu_cores']} cores, "
                     f"{hw['memory_total_bytes'] / 2**30:.1f} GiB, {gpus}; {test} ({st['latency_ms']} ms)")
    lines += ["", "MODEL                     FORMAT  SIZE      CONTEXT  SHA256"]
    lines += [f"{m['name']:<25} {m['format']:<7} {m['size_bytes'] / 2**20:>6.1f}MiB {m['context_length']:>7}  "
              f"{m['sha256'][:16]}" for m in report["models"]]
    return "\n".join(lines)

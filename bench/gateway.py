"""The mesh's own overhead: identical streamed requests sent straight to a sim
engine over gRPC, through a bare grpcio-aio relay (bench.grpc_relay: the floor of a
Python streaming hop), and through the gateway (gRPC and OpenAI HTTP/SSE), at
several concurrencies. The sim engine makes every token take the same time, so the
difference is what the gateway adds.

Every process shares the machine's cores, the bench's own client included, so each
run also gives the CPU per request of the gateway, the engine, the relay and this
process. The streams run in a closed loop with answers of one length: they finish
on the same decode step and their next requests reach the gateway together, so at
32 and 256 streams the added TTFT is mostly the gateway's per-request CPU times the
burst, rounded up to whole decode steps (a request that reaches the engine after a
step began waits for the next one).

    python -m bench.gateway [--levels 1,32,256] [--requests 100,640,1280]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import orjson

from llmesh.rpc.channels import mesh_channel
from llmesh.testing import Mesh, free_layout, free_ports, terminate
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from bench import grpc_relay
from bench.common import Sample, SseTally, child_pid, cpu_seconds, drive, note, sse_call

MODEL = "sim-small"
PROMPT = "Summarise the plot of a long novel in a few words please"


def sampling(tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=tokens, temperature=0.7)


async def engine_call(stub, tokens: int) -> Sample:
    req = engine_pb2.GenerateRequest(model=MODEL, sampling=sampling(tokens), chat=engine_pb2.ChatInput(
        messages=[common_pb2.ChatMessage(role="user", content=PROMPT)]))
    start = time.perf_counter()
    ttft, n, messages = None, 0, 0
    async for resp in stub.Generate(req, timeout=60):
        if resp.text and ttft is None:
            ttft = time.perf_counter() - start
        n += resp.token_count
        messages += 1
    return Sample(ttft, time.perf_counter() - start, n, messages)


async def gateway_grpc_call(stub, tokens: int, metadata: tuple[tuple[str, str], ...] = ()) -> Sample:
    req = gateway_pb2.ChatRequest(model=MODEL, sampling=sampling(tokens),
                                  messages=[common_pb2.ChatMessage(role="user", content=PROMPT)])
    start = time.perf_counter()
    ttft, n = None, 0
    async for resp in stub.Chat(req, timeout=60, metadata=metadata):
        if resp.text and ttft is None:
            ttft = time.perf_counter() - start
        if resp.finish_reason:
            n = resp.usage.completion_tokens
    return Sample(ttft, time.perf_counter() - start, n)


async def gateway_http_call(client: httpx.AsyncClient, url: str, tokens: int) -> Sample:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}}
    return await sse_call(client, url, body)


def sse_session(connections: int, timeout_s: float = 60,
                headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """The load runs' HTTP client to the gateway (``headers`` on every request: its API key,
    where it needs one). aiohttp, not httpx: httpx spent ~4 ms of the bench's own CPU a
    streamed request (~0.4 ms here), and its pool slows down with hundreds of connections;
    on a shared 2-core machine that CPU was taken from the gateway and the 256-stream HTTP
    figure measured the client (``client_cpu_ms_per_request``)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s), headers=headers)


def chat_body(tokens: int) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                         "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}})


async def gateway_sse_call(session: aiohttp.ClientSession, url: str, body: bytes) -> Sample:
    """One streamed chat completion over aiohttp (bench.common.SseTally)."""
    tally = SseTally()
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            tally.line(line)
    return tally.sample()


async def client_floor(channel, http: aiohttp.ClientSession, base_url: str, n: int = 200) -> dict:
    """What one round trip costs the two client stacks against the same gateway
    process doing almost nothing (gRPC health check, GET /healthz): the part of
    gateway_http's added TTFT that is the HTTP client's, not the gateway's."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    out = {}
    async def healthz() -> None:
        async with http.get(base_url + "/healthz") as resp:
            await resp.read()

    for name, call in (("grpc_ms_p50", lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=5)),
                       ("http_ms_p50", healthz)):
        times = []
        for _ in range(n):
            t = time.perf_counter()
            await call()
            times.append((time.perf_counter() - t) * 1000)
        out[name] = round(sorted(times)[n // 2], 3)
    out["http_minus_grpc_ms"] = round(out["http_ms_p50"] - out["grpc_ms_p50"], 3)
    return out


async def measure(mesh: Mesh, levels: list[int], counts: list[int], tokens: int, paths: list[str],
                  rounds: int = 3, headers: dict[str, str] | None = None) -> dict:
    """Every path at every level. Each path's run also gives the CPU per request of the
    gateway, the engine and this bench process itself (its client stack: the direct
    and gateway gRPC paths use the same one, one channel each, so they pay the same).
    ``headers`` (an API key) go on every gateway call, gRPC (as metadata) and HTTP, and
    nowhere else."""
    pids = {"gateway": child_pid(mesh.proc.pid, "llmesh.gateway"),
            "engine": child_pid(mesh.proc.pid, "llmesh.engine"), "client": os.getpid()}
    relay = relay_address = None
    if "relay_grpc" in paths:  # the floor: a bare grpcio-aio relay in front of the same engine
        port = free_ports(1)[0]
        relay, relay_address = grpc_relay.start(port, mesh.layout.engine_address(0)), f"127.0.0.1:{port}"
        pids["relay"] = relay.pid
    try:
        return await _measure(mesh, levels, counts, tokens, paths, pids, relay_address, rounds, headers or {})
    finally:
        if relay is not None:
            terminate(relay, signal.SIGTERM, 5)


async def _measure(mesh: Mesh, levels: list[int], counts: list[int], tokens: int, paths: list[str],
                   pids: dict[str, int], relay_address: str | None, rounds: int, headers: dict[str, str]) -> dict:
    out: dict = {}
    body = chat_body(tokens)
    metadata = tuple((k.lower(), v) for k, v in headers.items())  # gRPC metadata keys are lower case
    async with mesh_channel(mesh.layout.engine_address(0), "engine") as ech, \
            mesh_channel(mesh.layout.address("gateway"), "gateway") as gch, \
            mesh_channel(relay_address or mesh.layout.engine_address(0), "engine") as rch, \
            sse_session(max(levels) + 16, headers=headers) as http:
        engine = engine_pb2_grpc.EngineStub(ech)
        gateway = gateway_pb2_grpc.GatewayStub(gch)
        relay = engine_pb2_grpc.EngineStub(rch)
        url = mesh.layout.http_url + "/v1/chat/completions"
        calls = {
            "engine_grpc": lambda i: engine_call(engine, tokens),
            "relay_grpc": lambda i: engine_call(relay, tokens),
            "gateway_grpc": lambda i: gateway_grpc_call(gateway, tokens, metadata),
            "gateway_http": lambda i: gateway_sse_call(http, url, body),
        }
        for name in paths:  # warm every path's connections and code
            await drive(calls[name], 4, 20)
        out["client_floor"] = await client_floor(gch, http, mesh.layout.http_url)
        for level, count in zip(levels, counts):
            for name in paths:  # open this level's connections
                await drive(calls[name], level, min(level, count))
            # Rounds in rotating order, each path ``count / rounds`` requests a round: the machine's
            # load drifts (the cores are shared), so a path is compared with the direct run of its
            # own round and the figures are medians over rounds.
            runs: list[dict[str, dict]] = []
            for k in range(rounds):
                run = {}
                for name in paths[k % len(paths):] + paths[:k % len(paths)]:
                    cpu0 = {who: cpu_seconds(pid) for who, pid in pids.items()}
                    run[name] = r = await drive(calls[name], level, max(count // rounds, 1))
                    for who, pid in pids.items():
                        r[f"{who}_cpu_ms"] = (cpu_seconds(pid) - cpu0[who]) * 1000
                    note(f"c={level:<4} round {k + 1} {name:<13} ttft p50 {r['ttft_ms_p50']:.2f} ms  "
                         f"p99 {r['ttft_ms_p99']:.2f} ms  {r['tokens_per_s']:.0f} tok/s")
                runs.append(run)
            out[f"c{level}"] = _combine(runs, paths, list(pids))
    return out


def _combine(runs: list[dict[str, dict]], paths: list[str], processes: list[str]) -> dict:
    """Per path: medians over rounds of p50/p99/tokens/s, CPU per request over all of them;
    beside the direct path, the median of each round's added TTFT and throughput ratio."""
    med = statistics.median
    row = {}
    for name in paths:
        rs = [run[name] for run in runs]
        n = sum(r["requests"] for r in rs)
        row[name] = {"requests": n, "errors": sum(r["errors"] for r in rs), "rounds": len(rs),
                     "ttft_ms_p50": round(med(r["ttft_ms_p50"] for r in rs), 3),
                     "ttft_ms_p99": round(med(r["ttft_ms_p99"] for r in rs), 3),
                     "tokens_per_s": round(med(r["tokens_per_s"] for r in rs), 1),
                     "per_stream_tokens_per_s": round(med(r["per_stream_tokens_per_s"] or 0 for r in rs), 1)}
        for who in processes:
            row[name][f"{who}_cpu_ms_per_request"] = round(sum(r[f"{who}_cpu_ms"] for r in rs) / max(n, 1), 3)
    if "engine_grpc" in paths:
        for name in paths:
            if name != "engine_grpc":
                pairs = [(run[name], run["engine_grpc"]) for run in runs]
                row[name]["added_ttft_ms_p50"] = round(med(a["ttft_ms_p50"] - b["ttft_ms_p50"] for a, b in pairs), 3)
                row[name]["added_ttft_ms_p99"] = round(med(a["ttft_ms_p99"] - b["ttft_ms_p99"] for a, b in pairs), 3)
                row[name]["throughput_ratio"] = round(med(a["tokens_per_s"] / max(b["tokens_per_s"], 1e-9)
                                                          for a, b in pairs), 3)
    for name, r in row.items():
        note(f"  {name:<13} ttft p50 {r['ttft_ms_p50']:.2f} ms (+{r.get('added_ttft_ms_p50', 0):.2f})  "
             f"{r['tokens_per_s']:.0f} tok/s (x{r.get('throughput_ratio', 1):.2f})  CPU ms/req: "
             + " ".join(f"{who} {r[f'{who}_cpu_ms_per_request']:.2f}" for who in processes))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,32,256")
    parser.add_argument("--requests", default="60,384,3072", help="requests per level, over all rounds")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of every level's paths")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per response")
    parser.add_argument("--decode-ms", type=float, default=25.0,
                        help="sim time per decode step (25 ms: ~40 tok/s a stream, a loaded GPU)")
    parser.add_argument("--prefill-ms", type=float, default=1.0, help="sim prefill time per prompt token")
    parser.add_argument("--paths", default="engine_grpc,relay_grpc,gateway_grpc,gateway_http")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    paths = args.paths.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        mesh = Mesh(layout=free_layout(1), engines="sim", model_dir=Path(tmp) / "models", log_dir=Path(tmp) / "logs",
                    env={"LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": str(args.decode_ms),
                         "LLMESH_ENGINE_SIM_PREFILL_MS_PER_TOKEN": str(args.prefill_ms),
                         "LLMESH_ENGINE_MAX_RUNNING": "1024", "LLMESH_ENGINE_MAX_WAITING": "1024",
                         "LLMESH_GATEWAY_LOG_LEVEL": "warning", "LLMESH_ENGINE_LOG_LEVEL": "warning"})
        mesh.start(timeout_s=60)
        try:
            results = asyncio.run(measure(mesh, levels, counts, args.tokens, paths, args.rounds))
        finally:
            mesh.stop(signal.SIGINT)
    print(json.dumps({"bench": "gateway", "backend": "sim", "tokens_per_response": args.tokens,
                      "sim_decode_ms_per_token": args.decode_ms, "sim_prefill_ms_per_token": args.prefill_ms,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()

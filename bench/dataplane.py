"""The data plane's own cost, in one run, as ratios against what sits beside it:

- the gateway in front of an instant OpenAI-compatible server (bench.instant_openai),
  non-streamed and streamed (``--chunks`` chunks), one connection: gateway CPU per
  request and added p50, beside vLLM's Rust router (``vllm-router``, started here,
  pointed at the same server) and the Python floor (bench.relay_floor: Python's HTTP
  server and client with no logic) under the same load;
- the gateway in front of a sim engine at 0 ms per step: gateway CPU per request
  (non-streamed and streamed), and the engine wrapper's own CPU per request;
- added TTFT at 1, 32 and 256 streams and the gateway/direct throughput at 256,
  gRPC and HTTP (bench.gateway's measurement, sim engine at ``--decode-ms``);
- 1,000 concurrent HTTP streams through one gateway: errors, p50/p99, peak RSS.

    python -m bench.dataplane [--requests 300] [--json]
    python -m bench.dataplane --sections fronts --secure   # the same mesh as `llmesh up --secure`

``--secure`` (fronts section): the mesh runs with production trust (mutual TLS between
services, gateway API keys required); every request carries an API key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmesh.rpc.channels import mesh_channel
from llmesh.testing import Mesh, free_layout, free_ports, port_open, terminate, wait_until
from llmesh.v1 import engine_pb2_grpc
from bench import gateway as gw_bench
from bench import instant_openai
from bench import provider as provider_bench
from bench import relay_floor
from bench.common import Sample, child_pid, cpu_seconds, drive, note, pct, process_tree
from bench.workers import gateway_workers

SIM = gw_bench.MODEL
QUIET = {"LLMESH_GATEWAY_LOG_LEVEL": "warning", "LLMESH_ENGINE_LOG_LEVEL": "warning"}


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """``field`` of /proc/PID/status summed over ``pid`` and its descendants (a gateway's workers)."""
    kib = 0
    for p in process_tree(pid):
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                kib += int(line.split()[1])
                break
        else:
            raise LookupError(field)
    return round(kib / 1024, 1)


def router_binary() -> str:
    found = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(found).exists():
        raise SystemExit("vllm-router is not installed: .venv/bin/pip install -e '.[bench]'")
    return found


def start_router(upstream: str) -> tuple[subprocess.Popen, str]:
    port, metrics_port = free_ports(2)  # its metrics exporter's default port (29000) may be taken by another run
    proc = subprocess.Popen([router_binary(), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", upstream,
                             "--policy", "round_robin", "--log-level", "warning",
                             "--prometheus-port", str(metrics_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    if not wait_until(lambda: port_open(port) or proc.poll() is not None, 30) or proc.poll() is not None:
        terminate(proc, signal.SIGTERM, 5)
        raise RuntimeError("vllm-router did not start")
    return proc, f"http://127.0.0.1:{port}/v1/chat/completions"


async def timed(one, pids: dict[str, int], concurrency: int, requests: int) -> dict:
    """``drive`` with the CPU each named process spent, per request."""
    await drive(one, concurrency, min(20, requests))  # warm connections and code
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    r = await drive(one, concurrency, requests)
    n = max(r["requests"], 1)
    r["requests_per_s"] = round(r["requests"] / r["wall_s"], 1)
    for name, pid in pids.items():
        r[f"{name}_cpu_ms_per_request"] = round((cpu_seconds(pid) - before[name]) * 1000 / n, 3)
    return r


async def fronts(direct: str, gateway: str, router: str, floor: str, gw_pid: int, router_pid: int, floor_pid: int,
                 requests: int, rounds: int, headers: dict[str, str]) -> dict:
    """The gateway, vllm-router and the Python floor (bench.relay_floor: Python's HTTP server
    and client, no logic), each alone in front of the same instant server, one connection;
    ``rounds`` alternating rounds (the machine's load drifts), the median p50."""
    out = {}
    targets = (("direct", direct, {}), ("gateway", gateway, {"gateway": gw_pid}),
               ("vllm_router", router, {"router": router_pid}), ("python_floor", floor, {"floor": floor_pid}))
    async with httpx.AsyncClient(timeout=60, headers=headers) as client:
        for stream in (False, True):
            runs: dict[str, list[dict]] = {name: [] for name, _, _ in targets}
            for k in range(rounds):
                for name, url, pids in targets[k % len(targets):] + targets[:k % len(targets)]:
                    runs[name].append(await timed(lambda i, u=url: provider_bench.call(client, u, stream), pids, 1,
                                                  max(requests // rounds, 1)))
            row = {}
            for name, rs in runs.items():
                n = sum(r["requests"] for r in rs)
                row[name] = {"requests": n, "errors": sum(r["errors"] for r in rs),
                             "ms_p50": round(statistics.median(r["ttft_ms_p50"] for r in rs), 3),
                             "ms_p99": round(statistics.median(r["ttft_ms_p99"] for r in rs), 3)}
                for key in rs[0]:
                    if key.endswith("cpu_ms_per_request"):
                        row[name][key] = round(sum(r[key] * r["requests"] for r in rs) / max(n, 1), 3)
            for name in ("gateway", "vllm_router", "python_floor"):
                row[name]["added_ms_p50"] = round(row[name]["ms_p50"] - row["direct"]["ms_p50"], 3)
            gw_cpu = row["gateway"]["gateway_cpu_ms_per_request"]
            router_cpu = max(row["vllm_router"]["router_cpu_ms_per_request"], 1e-3)
            floor_cpu = max(row["python_floor"]["floor_cpu_ms_per_request"], 1e-3)
            row["gateway_over_router_cpu"] = round(gw_cpu / router_cpu, 2)
            row["gateway_over_floor_cpu"] = round(gw_cpu / floor_cpu, 2)  # the gateway's own work on top of Python's
            row["floor_over_router_cpu"] = round(floor_cpu / router_cpu, 2)  # Python's HTTP stack against Rust's
            key = "stream" if stream else "plain"
            out[key] = row
            note(f"{key:<6} gateway CPU {gw_cpu:.3f} ms/req, added p50 {row['gateway']['added_ms_p50']:.2f} ms | "
                 f"vllm-router CPU {router_cpu:.3f} ms/req, added p50 {row['vllm_router']['added_ms_p50']:.2f} ms | "
                 f"python floor CPU {floor_cpu:.3f} ms/req, added p50 {row['python_floor']['added_ms_p50']:.2f} ms")
    return out


async def sim_plain(client: httpx.AsyncClient, url: str, tokens: int) -> Sample:
    body = {"model": SIM, "messages": [{"role": "user", "content": gw_bench.PROMPT}], "max_tokens": tokens,
            "temperature": 0.7}
    start = time.perf_counter()
    resp = await client.post(url, json=body)
    resp.raise_for_status()
    total = time.perf_counter() - start
    return Sample(total, total, resp.json()["usage"]["completion_tokens"])


def engine_channel(mesh: Mesh, pki: Path | None):
    """A channel to engine-0 as the gateway has one: plaintext, or mutual TLS with the gateway's
    certificate on a secure mesh (Generate is the gateway's to call)."""
    identity = None
    if pki is not None:
        from llmesh.rpc.identity import Credentials, Identity
        from llmesh.rpc.pki import identity_files

        files = identity_files(pki, "gateway")
        identity = Identity("gateway", "tls", Credentials.load(files.ca_file, files.cert_file, files.key_file))
    return mesh_channel(mesh.layout.engine_address(0), "engine", identity)


async def engine_cost(mesh: Mesh, tokens: int, requests: int, headers: dict[str, str], pki: Path | None) -> dict:
    """Sim engine at 0 ms per step: what its process spends per request and, of that, its
    wrapper's share (the process less what the sim backend alone spends on the same answers,
    bench.engine_floor), next to a bare grpc.aio servicer sending as many messages (the
    floor under any Python gRPC wrapper); and what the gateway spends in front of it. One
    connection throughout."""
    from bench import engine_floor

    gw_pid = child_pid(mesh.proc.pid, "llmesh.gateway")
    eng_pid = child_pid(mesh.proc.pid, "llmesh.engine")
    pids = {"gateway": gw_pid, "engine": eng_pid}
    url = mesh.layout.http_url + "/v1/chat/completions"
    out = {}
    async with engine_channel(mesh, pki) as ech, httpx.AsyncClient(timeout=60, headers=headers) as http:
        engine = engine_pb2_grpc.EngineStub(ech)
        messages: list[int] = []

        async def direct(i: int) -> Sample:
            s = await gw_bench.engine_call(engine, tokens)
            messages.append(s.messages)
            return s

        for name, one in (("engine_direct_stream", direct),
                          ("gateway_http_plain", lambda i: sim_plain(http, url, tokens)),
                          ("gateway_http_stream", lambda i: gw_bench.gateway_http_call(http, url, tokens))):
            r = await timed(one, pids, 1, requests)
            out[name] = {k: r[k] for k in ("requests", "errors", "requests_per_s", "ttft_ms_p50",
                                           "gateway_cpu_ms_per_request", "engine_cpu_ms_per_request")}
            note(f"sim {name:<22} engine CPU {r['engine_cpu_ms_per_request']:.3f} ms/req, gateway CPU "
                 f"{r['gateway_cpu_ms_per_request']:.3f} ms/req")
    process = out["engine_direct_stream"]["engine_cpu_ms_per_request"]
    mean_messages = statistics.fmean(messages)
    out["engine_direct_stream"]["messages_per_answer_mean"] = round(mean_messages, 2)
    sim = await asyncio.to_thread(engine_floor.sim_alone, SIM, gw_bench.PROMPT, tokens,
                                  gw_bench.sampling(tokens).temperature, requests)
    floor = await engine_floor.grpc_floor(round(mean_messages), requests)
    wrapper = round(process - sim["cpu_ms_per_request"], 3)
    out |= {"engine_process_cpu_ms_per_request": process, "sim_backend_alone": sim,
            "engine_wrapper_cpu_ms_per_request": wrapper, "grpc_aio_floor": floor,
            "engine_wrapper_above_grpc_floor_cpu_ms_per_request": round(wrapper - floor["cpu_ms_per_request"], 3)}
    note(f"sim engine process {process:.3f} ms/req = sim alone {sim['cpu_ms_per_request']:.3f} + wrapper "
         f"{wrapper:.3f}; bare grpc.aio at {floor['messages']} messages {floor['cpu_ms_per_request']:.3f} ms/req "
         f"({floor['cpu_ms_one_message']:.3f} for one, {floor['cpu_ms_per_added_message']:.4f} a message more)")
    return out


async def many_streams(mesh: Mesh, streams: int, tokens: int, headers: dict[str, str]) -> dict:
    """``streams`` HTTP streams at once through the gateway, twice (memory must not grow),
    with the CPU per request of the gateway and of this bench process (its HTTP client);
    ``headers`` on every request (an API key, where the gateway needs one)."""
    gw_pid = child_pid(mesh.proc.pid, "llmesh.gateway")
    pids = {"gateway": gw_pid, "client": os.getpid()}
    url = mesh.layout.http_url + "/v1/chat/completions"
    body = gw_bench.chat_body(tokens)
    out: dict = {"rss_mib_before": rss_mib(gw_pid)}
    async with gw_bench.sse_session(streams + 16, timeout_s=120, headers=headers) as http:
        for round_ in (1, 2):
            totals: list[float] = []

            async def one(i: int) -> Sample:
                s = await gw_bench.gateway_sse_call(http, url, body)
                totals.append(s.total_s * 1000)
                return s

            cpu0 = {who: cpu_seconds(pid) for who, pid in pids.items()}
            r = await drive(one, streams, streams)
            cpu = {f"{who}_cpu_ms_per_request": round((cpu_seconds(pid) - cpu0[who]) * 1000 / max(r["requests"], 1), 3)
                   for who, pid in pids.items()}
            out[f"round{round_}"] = {"requests": r["requests"], "errors": r["errors"], "wall_s": r["wall_s"],
                                     "ttft_ms_p50": r["ttft_ms_p50"], "ttft_ms_p99": r["ttft_ms_p99"],
                                     "total_ms_p50": round(pct(totals, 50), 1),
                                     "total_ms_p99": round(pct(totals, 99), 1),
                                     "rss_mib_after": rss_mib(gw_pid), **cpu}
            note(f"{streams} streams round {round_}: {r['errors']} errors, total p50 {pct(totals, 50):.0f} ms, "
                 f"p99 {pct(totals, 99):.0f} ms, RSS {rss_mib(gw_pid)} MiB, CPU ms/req: client "
                 f"{cpu['client_cpu_ms_per_request']:.2f} gateway {cpu['gateway_cpu_ms_per_request']:.2f}")
    out["rss_mib_peak"] = rss_mib(gw_pid, "VmHWM")
    return out


def front_section(args, tmp: Path) -> dict:
    with (instant_openai.running(args.chunks) as base_url,
          relay_floor.running(base_url + "/chat/completions") as floor):
        return _fronts_against(args, tmp, base_url, floor)


def _fronts_against(args, tmp: Path, base_url: str, floor: tuple[str, int]) -> dict:
    router = None
    try:
        router, router_url = start_router(base_url.removesuffix("/v1"))
        (tmp / "a").mkdir()
        mesh = provider_bench.mesh(base_url, tmp / "a", args=("--no-cache", *(("--secure",) if args.secure else ())),
                                   env={"LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "0",
                                        "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": str(args.chunks)})
        headers, pki = secure_mesh(mesh, tmp / "a") if args.secure else ({}, None)
        mesh.start(timeout_s=90)
        try:
            gw_pid = child_pid(mesh.proc.pid, "llmesh.gateway")
            out = {"fronts_c1": asyncio.run(fronts(base_url + "/chat/completions", mesh.layout.http_url
                                                   + "/v1/chat/completions", router_url, floor[0], gw_pid, router.pid,
                                                   floor[1], args.requests, args.rounds, headers)),
                   "sim_0ms_c1": asyncio.run(engine_cost(mesh, args.chunks, args.requests, headers, pki))}
        finally:
            mesh.stop(signal.SIGINT)
    finally:
        if router is not None:
            terminate(router, signal.SIGTERM, 10.0)
    return out


def secure_mesh(mesh: Mesh, tmp: Path) -> tuple[dict[str, str], Path]:
    """For a mesh (not started) run with --secure: a tenant that may use the bench's models, an
    API key for it in the gateway's key file, the headers that carry it, and where the mesh's
    certificates will be (Mesh's state directory, <log_dir>/state)."""
    from llmesh.keys import FileKeyStore, new_key

    cfg = tmp / provider_bench.CONFIG
    doc = json.loads(cfg.read_text())
    doc["tenants"] = {"bench": {"models": [provider_bench.MODEL, SIM]}}
    cfg.write_text(json.dumps(doc))
    state = mesh.log_dir / "state"
    plaintext, record = new_key("bench")
    asyncio.run(FileKeyStore(state / "keys.json").put(record))
    return {"authorization": f"Bearer {plaintext}"}, state / "pki"


def load_section(args, tmp: Path) -> dict:
    # The config's "*" tenant grants the tenant of the gateway workers' API key (bench.workers).
    # The answer's PII masking (on by default) holds back a word that could still become PII until
    # the next token shows it did not: one decode step of TTFT that is the guard's, not overhead.
    cfg = tmp / "load.yaml"
    cfg.write_text(json.dumps({"tenants": {"*": {"guards": {"output_pii": args.output_pii}}}}))
    mesh = Mesh(layout=free_layout(1), engines="sim", model_dir=tmp / "models-b", log_dir=tmp / "logs-b",
                args=["--no-cache", *args.workers.flags],
                env={"LLMESH_CONFIG_FILE": str(cfg), "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": str(args.decode_ms),
                     "LLMESH_ENGINE_SIM_PREFILL_MS_PER_TOKEN": "0",
                     "LLMESH_ENGINE_MAX_RUNNING": "1024", "LLMESH_ENGINE_MAX_WAITING": "1024", **QUIET,
                     **args.workers.env})
    mesh.start(timeout_s=90)
    try:
        levels = [int(x) for x in args.levels.split(",")]
        counts = [int(x) for x in args.level_requests.split(",")]
        # relay_grpc: the floor, a bare grpcio-aio relay in front of the same engine (bench.grpc_relay).
        hops = ("relay_grpc", "gateway_grpc", "gateway_http")
        ttft = asyncio.run(gw_bench.measure(mesh, levels, counts, args.tokens, ["engine_grpc", *hops],
                                            args.load_rounds, args.workers.headers))
        summary = {}
        for level in levels:
            row = ttft[f"c{level}"]
            summary[f"c{level}"] = {f"{path}_added_ttft_ms_p50": row[path]["added_ttft_ms_p50"] for path in hops}
            summary[f"c{level}"] |= {f"{path}_throughput_ratio": row[path]["throughput_ratio"] for path in hops}
            summary[f"c{level}"]["relay_grpc_relay_cpu_ms_per_request"] = row["relay_grpc"]["relay_cpu_ms_per_request"]
            # The bench's own CPU per request: when it nears the gateway's, the figure measures the client.
            summary[f"c{level}"] |= {f"{path}_client_cpu_ms_per_request": row[path]["client_cpu_ms_per_request"]
                                     for path in ("engine_grpc", "gateway_grpc", "gateway_http")}
            summary[f"c{level}"] |= {f"{path}_gateway_cpu_ms_per_request": row[path]["gateway_cpu_ms_per_request"]
                                     for path in ("gateway_grpc", "gateway_http")}
        streams = asyncio.run(many_streams(mesh, args.streams, args.tokens, args.workers.headers))
    finally:
        mesh.stop(signal.SIGINT)
    return {"ttft_summary": summary, "ttft": ttft, f"streams_{args.streams}": streams}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per one-connection measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the one-connection runs")
    parser.add_argument("--chunks", type=int, default=32, help="chunks per streamed answer (tokens on the sim)")
    parser.add_argument("--levels", default="1,32,256")
    parser.add_argument("--level-requests", default="60,384,3072", help="requests per level of the TTFT runs")
    parser.add_argument("--load-rounds", type=int, default=3, help="alternating rounds of the TTFT runs' paths")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer in the TTFT and 1,000-stream runs")
    parser.add_argument("--decode-ms", type=float, default=25.0, help="sim step time for the TTFT runs")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--output-pii", choices=("mask", "off"), default="off",
                        help="the answer's PII masking in the TTFT and 1,000-stream runs (off: the default)")
    parser.add_argument("--sections", default="fronts,load")
    parser.add_argument("--gateway-workers", type=int, default=None, metavar="N",
                        help="load section: a gateway of N worker processes, with Redis (bench.workers)")
    parser.add_argument("--json", action="store_true", help="print only the JSON document on stdout (the default)")
    parser.add_argument("--secure", action="store_true", help="fronts section: the mesh as `llmesh up --secure` "
                        "(mutual TLS inside, API keys at the gateway)")
    args = parser.parse_args()
    sections = args.sections.split(",")
    if args.secure and "load" in sections:
        parser.error("--secure measures the fronts section only: add --sections fronts")
    results: dict = {}
    with (tempfile.TemporaryDirectory() as tmp,
          gateway_workers(args.gateway_workers, Path(tmp)) as args.workers):
        if "fronts" in sections:
            results |= front_section(args, Path(tmp))
        if "load" in sections:
            results |= load_section(args, Path(tmp))
    print(json.dumps({"bench": "dataplane", "secure": args.secure, "chunks": args.chunks, "requests": args.requests,
                      "output_pii": args.output_pii, "gateway_workers": args.gateway_workers,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()

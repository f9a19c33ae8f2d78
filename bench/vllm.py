"""llmesh (gateway + vllm engine) next to vLLM's own OpenAI server, on the same model, machine,
prompts and sampling, at several concurrency levels, in alternating rounds.

    .venv-vllm/bin/python -m bench.vllm --json        (make vllm-cpu vllm-model first)

Both are asked the same streamed chat completions over HTTP/SSE by the same client: vLLM's
server (``python -m vllm.entrypoints.openai.api_server``; the distribution is vllm-cpu here, so
``vllm serve`` cannot find its metadata) and the gateway of a mesh (``llmesh up --engines ''
--no-cache``) whose one engine is ``LLMESH_ENGINE_BACKEND=vllm`` on the same model directory,
dtype, eager mode and KV-cache size. Both start at once and stay up (two vLLMs, ~3.5 GiB each
here); rounds run every level on one side, then on the other, the next round starting with the
other side. ``--one-at-a-time`` needs half the memory: each round starts and stops each side
(a vLLM start took 30 s on an idle machine of this kind, 7.5 minutes on a loaded one). Per
level: tokens/s (completion tokens over the level's wall time), TTFT p50/p99, ITL p50 (per request,
(last content chunk - first) / (tokens - 1), so a chunk carrying several tokens counts each), the
first content chunk's gap to the second (p50: the wait a first token held back for one more costs),
CPU ms per request of each process tree, and per round the ratio llmesh / vLLM server
and the added TTFT p50; the level's figures are the rounds' medians. Each side's engine also
measures TTFT itself (``vllm:time_to_first_token_seconds``: from the tokenized request's arrival
at AsyncLLM to its first token); the client's mean minus the engine's is the time a first token
spends in the serving path (``path_ttft_ms_mean``), and llmesh's minus the server's is
``ttft_path_added_ms``: the added TTFT without the engine's queueing and prefill, which make up
nearly all of a TTFT on a CPU and vary by tens of ms from round to round.

The gateway runs as shipped (PII masking of prompts, the injection screen in ``flag`` mode),
with every guard off (``--guards off``), or as shipped plus the answers' PII masking
(``--guards answer``, a tenant's ``output_pii: mask``), which holds back a word that could still
become PII until the next token: one decode step of TTFT (docs/benchmarks.md). The bench also scrapes
both /metrics pages and reports any `vllm:` family the engine exports that vLLM's page shows
otherwise (tests/vllm_metrics.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from llmesh.testing import Mesh, Service, free_layout, free_ports, pid_alive, wait_until
from bench.common import child_pid, cpu_seconds, note, pct, process_tree

MODEL = "smollm2-vllm"
MODEL_DIR = Path.home() / ".cache/llmesh/models/smollm2-135m-instruct-hf-fp32"
TOPICS = ("a dragon", "the sea", "a robot", "a lighthouse", "a fox", "a city at night", "a clockmaker",
          "a comet", "a garden", "a violin", "a desert", "a glacier", "a library", "a train", "a storm", "a bee")
GUARDS = {"shipped": {}, "off": {"pii": "off", "output_pii": "off", "injection": "off"},
          "answer": {"output_pii": "mask"}}  # --guards: the tenants' guards over the defaults
QUIET = {"LLMESH_GATEWAY_LOG_LEVEL": "warning", "LLMESH_ENGINE_LOG_LEVEL": "warning",
         "LLMESH_SCHEDULER_LOG_LEVEL": "warning", "LLMESH_MODELMGR_LOG_LEVEL": "warning"}


@dataclass(frozen=True)
class VllmConfig:
    """What both sides give vLLM: the model, its dtype and window, eager mode, the KV cache."""
    model_dir: Path = MODEL_DIR
    served_name: str = MODEL
    dtype: str = "float32"  # the model's own: vLLM would downcast to bf16 on CPUs and drift
    max_model_len: int = 2048
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE

    @property
    def env(self) -> dict[str, str]:
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}


@dataclass
class VllmServer:
    """vLLM's own OpenAI server on 127.0.0.1 as a child process of this interpreter (which must
    have vLLM: .venv-vllm). ``start`` returns once ``/health`` answers 200."""
    config: VllmConfig
    log_path: Path
    port: int = 0
    service: Service | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600.0) -> None:
        if not self.port:
            (self.port,) = free_ports(1)
        c = self.config
        self.service = svc = Service("vllm.entrypoints.openai.api_server", c.env, self.log_path, args=[
            "--model", str(c.model_dir), "--served-model-name", c.served_name, "--dtype", c.dtype,
            "--max-model-len", str(c.max_model_len), "--enforce-eager", "--host", "127.0.0.1",
            "--port", str(self.port)])
        svc.start()
        assert svc.proc is not None
        if not wait_until(lambda: _healthy(self.url) or svc.proc.poll() is not None, timeout_s, 0.5) \
                or svc.proc.poll() is not None:
            self.stop()
            raise RuntimeError("vLLM's OpenAI server did not start:\n" + self.log_path.read_text()[-3000:])

    @property
    def pid(self) -> int:
        assert self.service is not None and self.service.proc is not None
        return self.service.proc.pid

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> None:
        stop_tree(self.service)


def stop_tree(service: Service | None) -> None:
    """Stops ``service`` (SIGTERM, SIGKILL after 60 s) and then kills any process it started that
    outlived it (vLLM's engine core, ~3.5 GiB, must not be left behind)."""
    if service is None or service.proc is None:
        return
    tree = process_tree(service.proc.pid)[1:]
    service.stop(timeout_s=60)
    for pid in tree:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class LlmeshVllm:
    """A mesh with no engine of its own (``llmesh up --engines '' --no-cache``: gateway,
    scheduler, model manager) and one vllm engine started beside it as engine-0, reporting
    to the mesh's scheduler, so the gateway routes to it. The mesh stays up between rounds;
    ``start_engine``/``stop_engine`` start and stop the engine (the vLLM part)."""
    config: VllmConfig
    tmp: Path
    guards: str = "shipped"
    mesh: Mesh | None = None
    engine: Service | None = None

    def start_mesh(self) -> None:
        env = dict(QUIET)
        guards = GUARDS[self.guards]
        if guards:
            cfg = self.tmp / "llmesh.yaml"
            cfg.write_text(json.dumps({"tenants": {"*": {"guards": guards}}}))
            env["LLMESH_CONFIG_FILE"] = str(cfg)
        self.mesh = Mesh(layout=free_layout(1), engines="", model_dir=self.tmp / "models",
                         log_dir=self.tmp / "mesh", env=env, args=["--no-cache"])
        self.mesh.start(timeout_s=300)

    @property
    def url(self) -> str:
        assert self.mesh is not None
        return self.mesh.layout.http_url

    def start_engine(self, timeout_s: float = 600.0) -> None:
        assert self.mesh is not None
        lay, c = self.mesh.layout, self.config
        self.engine = svc = Service("llmesh.engine", {
            **c.env, **QUIET, "LLMESH_ENGINE_BACKEND": "vllm", "LLMESH_ENGINE_MODEL": c.served_name,
            "LLMESH_ENGINE_VLLM_MODEL_PATH": str(c.model_dir), "LLMESH_ENGINE_VLLM_DTYPE": c.dtype,
            "LLMESH_ENGINE_VLLM_MAX_MODEL_LEN": str(c.max_model_len), "LLMESH_ENGINE_VLLM_ENABLE_LORA": "false",
            "LLMESH_ENGINE_VLLM_ENGINE_ARGS": json.dumps({"enforce_eager": True}),
            "LLMESH_ENGINE_PORT": lay.engine_address(0).rsplit(":", 1)[1], "LLMESH_ENGINE_ENDPOINT_ID": "engine-0",
            "LLMESH_ENGINE_SCHEDULER_ADDRESS": lay.address("scheduler"),
            "LLMESH_ENGINE_METRICS_PORT": str(lay.metrics_port("engine-0")),
            # vLLM's server has no admission limit: neither has this engine, below the levels run
            "LLMESH_ENGINE_MAX_RUNNING": "256", "LLMESH_ENGINE_MAX_WAITING": "1024",
            "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "3600"}, self.tmp / "engine-0.log")
        svc.start()
        assert svc.proc is not None
        # ready when the gateway answers for the model: the engine is up and the scheduler told the gateway
        if not wait_until(lambda: self._answers() or svc.proc.poll() is not None, timeout_s, 0.5) \
                or svc.proc.poll() is not None:
            self.stop_engine()
            raise RuntimeError("the vllm engine did not serve through the gateway:\n"
                               + (self.tmp / "engine-0.log").read_text()[-3000:])

    def _answers(self) -> bool:
        body = {"model": self.config.served_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        try:
            return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def pids(self) -> list[int]:
        """The gateway's and the engine's processes (the engine's tree holds vLLM's engine core)."""
        assert self.mesh is not None and self.mesh.proc is not None
        assert self.engine is not None and self.engine.proc is not None
        return [child_pid(self.mesh.proc.pid, "llmesh.gateway"), self.engine.proc.pid]

    def metrics(self) -> str:
        assert self.mesh is not None
        return httpx.get(f"http://127.0.0.1:{self.mesh.layout.metrics_port('engine-0')}/metrics", timeout=10).text

    def stop_engine(self) -> None:
        stop_tree(self.engine)
        self.engine = None

    def stop(self) -> None:
        self.stop_engine()
        if self.mesh is not None:
            self.mesh.stop()


# --- the client side: one streamed chat completion, a level of them ---

@dataclass
class Answer:
    ttft_s: float
    itl_s: float | None  # (last content - first content) / (tokens - 1); None for a single token
    tokens: int
    gap1_s: float | None = None  # first content chunk to the second; None with one chunk


async def ask(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Answer:
    """One streamed chat completion, greedy, with the usage chunk; times its content chunks."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = second = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                if first is not None and second is None:
                    second = last
                first = first or last
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None or last is None or not tokens:
        raise RuntimeError("an answer with no content or no usage")
    return Answer(first - start, (last - first) / (tokens - 1) if tokens > 1 else None, tokens,
                  second - first if second is not None else None)


def prompts(n: int, offset: int) -> list[str]:
    return [f"Write a short story about {TOPICS[(i + offset) % len(TOPICS)]} (number {i + offset})."
            for i in range(n)]


def engine_ttft(metrics_text: str) -> tuple[float, int]:
    """The sum (s) and count of ``vllm:time_to_first_token_seconds`` on a /metrics page: the TTFT
    the engine itself measured, from the request's arrival at AsyncLLM (tokenized) to its first
    token out of it, over every model and engine label."""
    total, count = 0.0, 0
    for line in metrics_text.splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:time_to_first_token_seconds_count"):
            count += int(float(line.rsplit(" ", 1)[1]))
    return total, count


async def level(client: httpx.AsyncClient, url: str, model: str, concurrency: int, requests: int,
                max_tokens: int, offset: int, pids: list[int], metrics: Callable[[], str]) -> dict:
    """``requests`` answers, ``concurrency`` in flight, the same prompts for both sides. Besides the
    client's TTFT, the engine's own (``vllm:time_to_first_token_seconds``, read before and after):
    their means' difference is the time a first token spends outside the engine (the HTTP server,
    the chat template and tokenizing, for llmesh the gateway and the gRPC hop), without the engine's
    queueing and prefill, which dominate a TTFT here and vary from round to round."""
    todo = iter(prompts(requests, offset))
    answers: list[Answer] = []
    errors = 0

    async def worker() -> None:
        nonlocal errors
        for prompt in todo:
            try:
                answers.append(await ask(client, url, model, prompt, max_tokens))
            except (httpx.HTTPError, RuntimeError) as exc:
                errors += 1
                note(f"  error: {type(exc).__name__}: {exc}")

    cpu0 = [cpu_seconds(p) for p in pids]
    ttft0 = engine_ttft(await asyncio.to_thread(metrics))
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0)]
    ttft1 = engine_ttft(await asyncio.to_thread(metrics))
    ttft = [a.ttft_s * 1000 for a in answers]
    itl = [a.itl_s * 1000 for a in answers if a.itl_s is not None]
    gap1 = [a.gap1_s * 1000 for a in answers if a.gap1_s is not None]
    n = max(len(answers), 1)
    engine_n = ttft1[1] - ttft0[1]
    engine_mean = (ttft1[0] - ttft0[0]) / engine_n * 1000 if engine_n else float("nan")
    client_mean = statistics.fmean(ttft) if ttft else float("nan")
    return {"requests": len(answers), "errors": errors, "tokens": sum(a.tokens for a in answers),
            "tokens_per_s": round(sum(a.tokens for a in answers) / wall, 2),
            "ttft_ms_p50": round(pct(ttft, 50), 2), "ttft_ms_p99": round(pct(ttft, 99), 2),
            "itl_ms_p50": round(pct(itl, 50), 2), "first_gap_ms_p50": round(pct(gap1, 50), 2),
            "first_gap_ms_mean": round(statistics.fmean(gap1), 2) if gap1 else float("nan"),
            "cpu_ms_per_request": [round(c / n * 1000, 1) for c in cpu],
            "ttft_ms_mean": round(client_mean, 2), "engine_ttft_ms_mean": round(engine_mean, 2),
            "engine_ttft_requests": engine_n, "path_ttft_ms_mean": round(client_mean - engine_mean, 2)}


# --- the run: rounds of levels, alternating which side goes first ---

@dataclass
class Side:
    name: str
    start: Callable[[], None]
    stop: Callable[[], None]
    url: Callable[[], str]
    pids: Callable[[], list[int]]
    metrics: Callable[[], str]
    rounds: dict[int, list[dict]] = field(default_factory=dict)


async def run_side(side: Side, args, round_no: int) -> None:
    limits = httpx.Limits(max_connections=max(args.levels) * 2, max_keepalive_connections=max(args.levels) * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        url = side.url()
        for i in range(args.warmup):  # first-call allocations, outside the figures
            await ask(client, url, MODEL, f"Say hello (warm-up {i}).", 8)
        pids = side.pids()
        for c in args.levels:
            note(f"round {round_no + 1}/{args.rounds}, {c} streams: {side.name}")
            requests = max(c * args.requests_per_stream, args.min_requests)
            result = await level(client, url, MODEL, c, requests, args.max_tokens, round_no * 1000 + c * 10, pids,
                                 side.metrics)
            note(f"  {json.dumps(result)}")
            side.rounds.setdefault(c, []).append(result)


def summarise(server: Side, llmesh: Side, levels: list[int]) -> dict:
    out: dict = {}
    for c in levels:
        s_rounds, l_rounds = server.rounds[c], llmesh.rounds[c]
        row: dict = {}
        for side, rounds in ((server, s_rounds), (llmesh, l_rounds)):
            row[side.name] = {
                "requests": sum(r["requests"] for r in rounds), "errors": sum(r["errors"] for r in rounds),
                **{k: round(statistics.median(r[k] for r in rounds), 2)
                   for k in ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "first_gap_ms_p50",
                             "first_gap_ms_mean", "ttft_ms_mean", "engine_ttft_ms_mean", "path_ttft_ms_mean")},
                "cpu_ms_per_request": [round(statistics.median(r["cpu_ms_per_request"][i] for r in rounds), 1)
                                       for i in range(len(rounds[0]["cpu_ms_per_request"]))]}
        ratios = [lr["tokens_per_s"] / sr["tokens_per_s"] for sr, lr in zip(s_rounds, l_rounds)]
        added = [lr["ttft_ms_p50"] - sr["ttft_ms_p50"] for sr, lr in zip(s_rounds, l_rounds)]
        path = [lr["path_ttft_ms_mean"] - sr["path_ttft_ms_mean"] for sr, lr in zip(s_rounds, l_rounds)]
        row["throughput_ratio"] = round(statistics.median(ratios), 3)
        row["ttft_path_added_ms"] = round(statistics.median(path), 2)
        row["round_ttft_path_added_ms"] = [round(a, 2) for a in path]
        row["ttft_added_ms_p50"] = round(statistics.median(added), 2)
        row["round_throughput_ratios"] = [round(r, 3) for r in ratios]
        row["round_ttft_added_ms_p50"] = [round(a, 2) for a in added]
        row["goal_met"] = row["throughput_ratio"] >= 0.95 and row["ttft_added_ms_p50"] <= 5
        # the server against itself, round to round (same requests, same side): wider than 5 ms, and one
        # side's p50 against the other's cannot tell 5 ms from noise at this level; None: one round
        own = [r["ttft_ms_p50"] for r in s_rounds]
        row["server_ttft_p50_spread_ms"] = round(max(own) - min(own), 2) if len(own) > 1 else None
        out[str(c)] = row
    return out


def metrics_check(server_text: str, engine_text: str) -> list[str]:
    """The `vllm:` families of the engine's /metrics that vLLM's own page lacks or shows otherwise."""
    from tests.vllm_metrics import families_from_text, metric_problems

    return metric_problems(families_from_text(engine_text), families_from_text(server_text))


def start_side(side: Side) -> None:
    started = time.monotonic()
    side.start()
    note(f"{side.name} ready in {time.monotonic() - started:.0f} s")


def run(args, tmp: Path) -> dict:
    config = VllmConfig(model_dir=args.model_dir, kv_cache_gib=args.kv_cache_gib)
    server = VllmServer(config, tmp / "vllm-server.log")
    llmesh = LlmeshVllm(config, tmp, guards=args.guards)
    texts: dict[str, str] = {}
    sides = [
        Side("vllm_server", server.start, server.stop, lambda: server.url, lambda: [server.pid], server.metrics),
        Side("llmesh", llmesh.start_engine, llmesh.stop_engine, lambda: llmesh.url, llmesh.pids, llmesh.metrics)]
    llmesh.start_mesh()
    try:
        if args.one_at_a_time:
            for r in range(args.rounds):
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    start_side(side)
                    try:
                        asyncio.run(run_side(side, args, r))
                        texts[side.name] = side.metrics()
                    finally:
                        side.stop()
        else:
            with ThreadPoolExecutor(2) as pool:  # both start at once: each start waits on its own child
                list(pool.map(start_side, sides))
            for r in range(args.rounds):
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    asyncio.run(run_side(side, args, r))
            texts = {side.name: side.metrics() for side in sides}
    finally:
        server.stop()
        llmesh.stop()
    return {"levels": summarise(sides[0], sides[1], args.levels),
            "metrics_problems": metrics_check(texts["vllm_server"], texts["llmesh"])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the JSON on one line")
    parser.add_argument("--levels", default="1,4,16", help="concurrent streams, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each starts both sides once, alternating")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=2, help="requests per level: this x streams")
    parser.add_argument("--min-requests", type=int, default=6, help="at least this many requests per level")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests after each start")
    parser.add_argument("--guards", choices=tuple(GUARDS), default="shipped",
                        help="the gateway's guards as shipped, all off (pii, output_pii, injection), or as "
                        "shipped plus the answers' PII masking (output_pii: mask)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="run one vLLM at a time: each round starts and stops each side (needs half the memory)")
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    args = parser.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    if not (args.model_dir / "config.json").is_file():
        sys.exit(f"no model at {args.model_dir}: run 'make vllm-model'")
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        sys.exit("bench.vllm needs vLLM: run it with .venv-vllm/bin/python (make vllm-cpu)")
    import importlib.metadata
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmesh-bench-vllm-") as tmp:
        result = run(args, Path(tmp))
    out = {"bench": "vllm", "model": MODEL, "vllm": importlib.metadata.version("vllm-cpu"),
           "dtype": "float32", "max_tokens": args.max_tokens, "rounds": args.rounds, "guards": args.guards,
           "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
           "cpu_ms_per_request_is": {"vllm_server": ["server (API process + engine core)"],
                                     "llmesh": ["gateway", "engine (its process + vLLM's engine core)"]},
           **result, "wall_s": round(time.monotonic() - started, 1)}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

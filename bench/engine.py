"""The llama.cpp engine under concurrent streams, next to llama-cpp-python's own
server (``python -m llama_cpp.server``) on the same model file, prompts, max_tokens,
greedy sampling and threads, in one run.

    llmesh bench engine [--json] [--levels 1,4,8,16] [--calibrate sim-profile.json]

Workloads: distinct short questions (decode-bound) at each level, and a long shared
system prompt with distinct questions (prefix reuse) next to distinct long prompts of
the same length (nothing to reuse). The engine is called over its gRPC API, the
server over its OpenAI HTTP API with SSE, each with all streams in flight at once.
``--calibrate`` fits a sim profile (step time vs batch size, prefill per token) to
the engine's figures and writes it for ``LLMESH_ENGINE_SIM_PROFILE``."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmesh.modelstore import ModelStore
from llmesh.rpc.channels import mesh_channel
from llmesh.testing import Service, free_ports, port_open, wait_until
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from bench.common import Sample, drive, note

MODEL = "smollm2-135m-instruct"
TOPICS = ("a dragon", "the sea", "a robot", "a lighthouse", "a fox", "a city at night", "a clockmaker",
          "a comet", "a garden", "a violin", "a desert", "a glacier", "a library", "a train", "a storm", "a bee")
SYSTEM = ("You are a careful assistant for a public library. Answer in plain words. "
          "Follow the house rules: be brief, be kind, cite the shelf when you name a book, never invent a title, "
          "say so when you do not know, keep lists short, avoid jargon, and end with one follow-up question. ") * 6


def questions(n: int, offset: int = 0) -> list[str]:
    return [f"Write a story about {TOPICS[(i + offset) % len(TOPICS)]} (number {i + offset})." for i in range(n)]


class Engine:
    """Our engine over gRPC."""

    name = "llmesh_engine"

    def __init__(self, address: str, model: str = MODEL):
        self.address = address
        self.model = model
        self.stamps: list[list[float]] = []  # per request, arrival of each token (for calibration)

    async def one(self, messages: list[dict], max_tokens: int) -> Sample:
        async with mesh_channel(self.address, "engine") as ch:
            req = engine_pb2.GenerateRequest(
                model=self.model, chat=engine_pb2.ChatInput(messages=[common_pb2.ChatMessage(**m) for m in messages]),
                sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0))
            start = time.perf_counter()
            stamps, tokens = [], 0
            async for resp in engine_pb2_grpc.EngineStub(ch).Generate(req, timeout=600):
                if resp.token_count:
                    stamps.append(time.perf_counter())
                if resp.finish_reason:
                    tokens = resp.usage.completion_tokens
        self.stamps.append(stamps)
        return Sample(ttft_s=stamps[0] - start, total_s=stamps[-1] - start, tokens=tokens)


class OpenAIServer:
    """An OpenAI-compatible server (llama-cpp-python's, vLLM's) over HTTP + SSE."""

    def __init__(self, url: str, name: str = "llama_cpp_server", model: str = MODEL):
        self.http = httpx.AsyncClient(base_url=url, timeout=600)
        self.name = name
        self.model = model

    async def one(self, messages: list[dict], max_tokens: int) -> Sample:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
        start = time.perf_counter()
        stamps = []
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if choice.get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())  # one chunk per token
        return Sample(ttft_s=stamps[0] - start, total_s=stamps[-1] - start, tokens=len(stamps))


async def level(target, concurrency: int, requests: int, max_tokens: int, system: str | None = None,
                offset: int = 0) -> dict:
    prompts = questions(requests, offset)

    async def one(i: int) -> Sample:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompts[i]}]
        return await target.one(msgs, max_tokens)

    return await drive(one, concurrency, requests)


def batched_decode_ceiling(model_path: Path, threads: int, levels: list[int], prompt_tokens: int,
                           steps: int) -> dict:
    """llama.cpp's own batched decode, no sampling and no serving: tokens/s with b
    sequences decoded together for ``steps`` tokens after a ``prompt_tokens`` prompt
    each (the workload's lengths), as a ratio to one sequence."""
    import llama_cpp as lc
    from llama_cpp import Llama

    from llmesh.modelstore import quiet_native_stderr

    with quiet_native_stderr():
        Llama(model_path=str(model_path), vocab_only=True, verbose=False)  # silences llama.cpp's log
        model = lc.llama_model_load_from_file(str(model_path).encode(), lc.llama_model_default_params())
    rates = {}
    for b in levels:
        params = lc.llama_context_default_params()
        per_seq = -(-(prompt_tokens + steps) // 256) * 256
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = b * per_seq, 512, 512, b
        params.n_threads = params.n_threads_batch = threads
        with quiet_native_stderr():
            ctx = lc.llama_init_from_model(model, params)
        batch = lc.llama_batch_init(512, 0, 1)

        def decode(items: list[tuple[int, int, int]]) -> None:
            for i, (tok, pos, seq) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, 1
                batch.seq_id[i][0] = seq
            batch.n_tokens = len(items)
            assert lc.llama_decode(ctx, batch) == 0

        for s in range(b):
            decode([(100 + j, j, s) for j in range(prompt_tokens)])
        start = time.perf_counter()
        for k in range(steps):
            decode([(200 + k, prompt_tokens + k, s) for s in range(b)])
        rates[b] = b * steps / (time.perf_counter() - start)
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
    lc.llama_model_free(model)
    return {str(b): {"tokens_per_s": round(r, 1), "vs_one": round(r / rates[levels[0]], 3)} for b, r in rates.items()}


def median_of(results: list[dict]) -> dict:
    """Per-key median of several rounds' summaries (requests and errors: totals)."""
    out = {}
    for key in results[0]:
        values = [r[key] for r in results if r[key] is not None]
        if key in ("requests", "errors"):
            out[key] = sum(values)
        else:
            out[key] = round(statistics.median(values), 3) if values else None
    return out


def fit_profile(by_level: dict[int, list[list[float]]], prefill: dict, args) -> dict:
    """Step time = base + per_seq * batch, least squares over the levels' median
    inter-token gaps; prefill per token from the cold long-prompt TTFT."""
    points = []
    for c, requests in by_level.items():
        gaps = [b - a for stamps in requests for a, b in zip(stamps, stamps[1:])]
        if gaps:
            points.append((c, statistics.median(gaps) * 1000))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(points) >= 2:
        slope, intercept = statistics.linear_regression(xs, ys)
    else:
        slope, intercept = 0.0, ys[0]
    per_seq = max(slope, 0.0)
    base = max(intercept, 0.1)
    prefill_ms = max((prefill["ttft_ms_p50"] - (base + per_seq)) / prefill["prompt_tokens"], 0.0)
    return {"prefill_ms_per_token": round(prefill_ms, 4), "decode_ms_base": round(base, 3),
            "decode_ms_per_seq": round(per_seq, 3), "kv_blocks": args.slots * args.n_ctx // 16, "block_size": 16,
            "max_batch": args.slots, "output_tokens": args.max_tokens,
            "prefill_first": True,  # as the llama.cpp engine steps: a newcomer's prefill, then the others' decode
            "fitted_from": {"step_ms_by_batch": dict(points)}}


async def run(args, engine: Engine, server: OpenAIServer) -> dict:
    targets = [server, engine]
    out: dict = {"levels": {}, "shared_prefix": {}}
    by_level: dict[int, list[list[float]]] = {}
    # Warm both (first-call allocations), then each level: server, engine, alternating order.
    for t in targets:
        await level(t, 1, 1, 8)
    # Each level runs in rounds of `c` requests per target, the order alternating, so
    # both see the same drift of this machine; the ratio is the median of the rounds'.
    for c in args.levels:
        rounds: dict[str, list[dict]] = {t.name: [] for t in targets}
        engine.stamps = []
        for r in range(args.rounds):
            for t in (targets if r % 2 == 0 else targets[::-1]):
                note(f"level {c}, round {r + 1}/{args.rounds}: {t.name}")
                rounds[t.name].append(await level(t, c, c, args.max_tokens, offset=r * c))
        by_level[c] = engine.stamps
        row = {name: median_of(rs) for name, rs in rounds.items()}
        row["aggregate_ratio"] = round(statistics.median(
            e["tokens_per_s"] / s["tokens_per_s"] for e, s in zip(rounds[engine.name], rounds[server.name])), 3)
        row["round_ratios"] = [round(e["tokens_per_s"] / s["tokens_per_s"], 3)
                               for e, s in zip(rounds[engine.name], rounds[server.name])]
        out["levels"][str(c)] = row
    # Prefix reuse: a long system prompt shared by every request vs distinct long prompts.
    prompt_tokens = await count_tokens(engine.address, [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": questions(1)[0]}])
    for c in args.prefix_levels:
        row = {}
        for t in targets:
            note(f"shared prefix, {c} streams: {t.name}")
            shared = await level(t, c, max(2 * c, 4), args.prefix_max_tokens, system=SYSTEM, offset=100)
            distinct = await level_distinct(t, c, max(2 * c, 4), args.prefix_max_tokens)
            row[t.name] = {"shared_system_prompt": shared, "distinct_prompts": distinct}
        row["ttft_p50_ratio_engine_vs_server_shared"] = round(
            row[engine.name]["shared_system_prompt"]["ttft_ms_p50"]
            / row[server.name]["shared_system_prompt"]["ttft_ms_p50"], 3)
        out["shared_prefix"][str(c)] = row
    out["shared_prefix"]["prompt_tokens"] = prompt_tokens
    question_tokens = await count_tokens(engine.address, [{"role": "user", "content": questions(1)[0]}])
    out["llama_cpp_batched_decode_ceiling"] = batched_decode_ceiling(
        args.model_path, args.threads, sorted({1, *args.levels}), question_tokens, args.max_tokens)
    if args.calibrate:
        cold = out["shared_prefix"][str(args.prefix_levels[0])][engine.name]["distinct_prompts"]
        profile = fit_profile(by_level, {"ttft_ms_p50": cold["ttft_ms_p50"],
                                                  "prompt_tokens": prompt_tokens}, args)
        args.calibrate.write_text(json.dumps({k: v for k, v in profile.items() if k != "fitted_from"}, indent=2) + "\n")
        out["calibrated_profile"] = profile
    return out


_SALT = itertools.count()


async def level_distinct(target, concurrency: int, requests: int, max_tokens: int) -> dict:
    """Long prompts of the same length as SYSTEM that share nothing (a unique first line)."""
    async def one(i: int) -> Sample:
        system = f"Session {next(_SALT)}. " + SYSTEM
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": questions(1, i)[0]}]
        return await target.one(msgs, max_tokens)

    return await drive(one, concurrency, requests)


async def count_tokens(address: str, messages: list[dict]) -> int:
    async with mesh_channel(address, "engine") as ch:
        resp = await engine_pb2_grpc.EngineStub(ch).Tokenize(engine_pb2.TokenizeRequest(
            model=MODEL, chat=engine_pb2.ChatInput(messages=[common_pb2.ChatMessage(**m) for m in messages])))
        return resp.count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmesh bench engine", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--levels", default="1,4,8,16")
    parser.add_argument("--prefix-levels", default="1,8")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per level (c requests each)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prefix-max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--model-dir", type=Path, default=Path("var/models"))
    parser.add_argument("--calibrate", type=Path, help="write a sim profile fitted to the engine's figures here")
    args = parser.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    args.prefix_levels = [int(x) for x in args.prefix_levels.split(",")]
    record = ModelStore(args.model_dir).get(MODEL)
    if record is None:
        sys.exit(f"no model {MODEL} in {args.model_dir}; run 'make model' first")
    args.model_path = record.path
    engine_port, server_port = free_ports(2)
    with tempfile.TemporaryDirectory() as tmp:
        svc = Service("llmesh.engine", {
            "LLMESH_ENGINE_BACKEND": "llamacpp", "LLMESH_ENGINE_MODEL": MODEL,
            "LLMESH_ENGINE_MODEL_DIR": str(args.model_dir.resolve()), "LLMESH_ENGINE_PORT": str(engine_port),
            "LLMESH_ENGINE_SCHEDULER_ADDRESS": "", "LLMESH_ENGINE_MAX_RUNNING": str(args.slots),
            "LLMESH_ENGINE_MAX_WAITING": "1024", "LLMESH_ENGINE_N_CTX": str(args.n_ctx),
            "LLMESH_ENGINE_N_THREADS": str(args.threads), "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "3600"},
            Path(tmp) / "engine.log")
        server = Service("llama_cpp.server", {}, Path(tmp) / "server.log", args=[
            "--model", str(record.path), "--n_ctx", str(args.n_ctx), "--n_threads", str(args.threads),
            "--n_threads_batch", str(args.threads), "--host", "127.0.0.1", "--port", str(server_port),
            "--verbose", "False", "--interrupt_requests", "False"])  # queue concurrent requests
        svc.start()
        server.start()
        try:
            if not wait_until(lambda: port_open(engine_port) and port_open(server_port), 120):
                sys.exit("engine or llama_cpp.server did not start:\n" + svc.log_path.read_text()[-2000:]
                         + server.log_path.read_text()[-2000:])
            client = OpenAIServer(f"http://127.0.0.1:{server_port}")
            result = asyncio.run(run(args, Engine(f"127.0.0.1:{engine_port}"), client))
        finally:
            svc.stop()
            server.stop()
    result = {"bench": "engine", "model": MODEL, "max_tokens": args.max_tokens, "threads": args.threads,
              "slots": args.slots, "cpus": os.cpu_count(), **result}
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

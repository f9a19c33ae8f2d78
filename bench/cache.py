"""The response cache: what a hit costs, how fast a semantic lookup is at scale, and
how often the semantic cache answers the wrong question.

    llmesh bench cache [--json] [--hits 200] [--sizes 10000,100000] [--skip-mesh]

- exact hit end to end: the mesh (`llmesh up`, the llama.cpp engine, the cache on a
  real redis-server) answers one greedy question many times over HTTP; next to the
  same question asked of the engine directly over gRPC (what a miss costs at least);
- semantic lookup at 10k and 100k entries in one scope, embedding included (the
  real MiniLM on the query; the stored entries are random unit vectors: embedding
  100k real sentences here would take most of an hour, and the search does not care);
- quality on the labelled pairs in bench/data (English and Chinese; bench/cache_split.py):
  the semantic threshold is chosen on the development pairs (cache_pairs_*, cache_dev2_*:
  the lowest with false hits <= 1 %, guards on), recall, false-hit rate and precision are
  reported on the held-out pairs (cache_heldout_*) at it and at the shipped default, per
  language and kind, with the issue's goal met or not;
- ``--parts verifier``: the same pairs through the verifier (cosine at its candidate
  threshold, the guards, then the judge's yes), per language and kind, and the judge's
  latency; the judge is ``--judge-url`` or, by default, llmesh's own mesh (llama.cpp, SmolLM2).
  The candidate threshold is chosen on dev and the figures given on held-out, as for quality.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the cache service runs (before numpy loads)

import httpx
import numpy as np

from llmesh.embedding import MiniLM
from llmesh.cache.failopen import FailOpen
from llmesh.cache.guards import extract, refusal
from llmesh.cache.keys import Request, semantic_query
from llmesh.cache.memory import MemoryStore
from llmesh.cache.responses import ResponseCache
from llmesh.cache.semantic import SemanticIndex
from llmesh.cache.store import Entry, Name
from llmesh.liveconfig.schema import CacheVerifier, MeshConfig
from llmesh.cache.embedders import EmbedderSecrets
from llmesh.cache.verifier import HttpJudge
from llmesh.types import Message, Prompt, Sampling
from bench.cache_split import GRID, at_threshold, load_split, score, split_report
from bench.cache_latency import bench_latency
from bench.cache_stream import bench_stream
from bench.common import note, pct

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
SMOL = "smollm2-135m-instruct"
QUESTION = "Name three planets of the solar system."


def _ms(values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    return {"n": len(ms), "p50_ms": round(pct(ms, 50), 3), "p99_ms": round(pct(ms, 99), 3),
            "mean_ms": round(statistics.fmean(ms), 3)}


# --- exact hits through the mesh ------------------------------------------------------------
async def _engine_direct(address: str, runs: int, model: str) -> dict:
    from llmesh.rpc.channels import mesh_channel
    from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    req = engine_pb2.GenerateRequest(model=model, sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=32),
                                     chat=engine_pb2.ChatInput(messages=[common_pb2.ChatMessage(
                                         role="user", content=QUESTION)]))
    times, tokens = [], 0
    async with mesh_channel(address, "engine") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        for _ in range(runs):
            start = time.perf_counter()
            async for resp in stub.Generate(req, timeout=120):
                if resp.finish_reason:
                    tokens = resp.usage.completion_tokens
            times.append(time.perf_counter() - start)
    return {**_ms(times), "completion_tokens": tokens}


def _gateway(url: str, hits: int, model: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 32}
    with httpx.Client(base_url=url, timeout=120) as client:
        deadline = time.monotonic() + 120
        while True:  # the engine may still be registering after `up` returns (503)
            start = time.perf_counter()
            first = client.post("/v1/chat/completions", json=body)
            miss_s = time.perf_counter() - start
            if first.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        first.raise_for_status()
        deadline = time.monotonic() + 10
        while client.post("/v1/chat/completions", json=body).headers.get("x-llmesh-cache") != "hit":
            if time.monotonic() > deadline:
                raise RuntimeError("the answer never came from the cache")
            time.sleep(0.05)
        times, marked = [], 0
        for _ in range(hits):
            start = time.perf_counter()
            resp = client.post("/v1/chat/completions", json=body)
            times.append(time.perf_counter() - start)
            marked += resp.headers.get("x-llmesh-cache") == "hit"
        stream_times = []
        for _ in range(max(20, hits // 5)):
            start = time.perf_counter()
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
                for _ in resp.iter_bytes():
                    pass
            stream_times.append(time.perf_counter() - start)
    return {"first_answer_miss_ms": round(miss_s * 1000, 1), "hit": {**_ms(times), "marked_hit": marked},
            "hit_streamed": _ms(stream_times)}


def bench_exact(hits: int, engine_runs: int, engine: str, keep_logs: Path | None = None) -> dict:
    from llmesh.testing import Mesh, RedisServer, free_layout

    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        model = SMOL if engine == "llamacpp" else "sim-small"
        mesh = Mesh(layout=free_layout(1), engines=engine, model_dir=(ROOT / "var" / "models").resolve(),
                    log_dir=Path(tmp) / "logs",
                    env={"LLMESH_CACHE_BACKEND": "redis", "LLMESH_CACHE_REDIS_URL": redis.url,
                         "LLMESH_CONFIG_FILE": str(Path(tmp) / "llmesh.yaml"),
                         # the sim answers like a small GPU model: 25 ms a token
                         "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "25", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "32"})
        try:
            note(f"exact: starting the mesh ({engine} engine, cache on redis-server)")
            mesh.start()
            gateway = _gateway(mesh.layout.http_url, hits, model)
            engine_result = asyncio.run(_engine_direct(mesh.layout.engine_address(0), engine_runs, model))
        finally:
            mesh.stop()
            redis.stop()
            if keep_logs is not None:
                import shutil
                shutil.copytree(Path(tmp) / "logs", keep_logs, dirs_exist_ok=True)
    return {"engine": engine, "model": model, "question": QUESTION, "max_tokens": 32,
            "engine_direct_grpc": engine_result, "through_gateway_http": gateway,
            "hit_vs_engine_p50": round(engine_result["p50_ms"] / gateway["hit"]["p50_ms"], 1)}


# --- semantic lookup at scale ---------------------------------------------------------------
QUERIES = ["How can I reset my password?", "What's the capital of France?", "How do I cancel my subscription?",
           "Why does the sky look blue?", "How can I sort a list in Python?", "What is the boiling point of water?",
           "如何重置我的密码？", "怎么联系客服？"]


def bench_semantic(embedder: MiniLM, sizes: list[int], lookups: int) -> dict:
    embed_times, embed_cpu = [], []
    for i in range(lookups):
        text = QUERIES[i % len(QUERIES)] + f" ({i})"
        start, cpu = time.perf_counter(), time.process_time()
        embedder.encode(text)
        embed_times.append(time.perf_counter() - start)
        embed_cpu.append(time.process_time() - cpu)
    out: dict = {"embed_only": _ms(embed_times), "embed_only_cpu": _ms(embed_cpu),
                 "stored_entries": "random unit vectors in one scope"}
    rng = np.random.default_rng(7)
    for size in sizes:
        for mode, hnsw_min in (("numpy", size + 1), ("hnsw", 2000)):
            if mode == "numpy" and size > 100_000:
                continue
            note(f"semantic: {size} entries, {mode}")
            result = asyncio.run(_lookups(embedder, rng, size, hnsw_min, lookups))
            out[f"{size}_{mode}"] = result
    return out


async def _lookups(embedder: MiniLM, rng, size: int, hnsw_min: int, lookups: int) -> dict:
    index = SemanticIndex(embedder, hnsw_min=hnsw_min, memo=1)
    config = MeshConfig.model_validate({"cache": {"mode": "semantic"}})
    store = MemoryStore(size + 100)
    cache = ResponseCache(FailOpen(store, 1.0), index, lambda: config.cache)
    system = Message("system", "You are a helpful assistant.")
    scope = semantic_query(Request("bench", "m", Prompt(messages=(system, Message("user", "x"))),
                                   Sampling(temperature=0.0))).scope
    started = time.perf_counter()
    vectors = rng.normal(size=(size, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    batch = []
    for i, v in enumerate(vectors):
        name = Name("bench", "m", "s", f"{i:064x}")
        batch.append((name, scope, f"filler question {i}", v, 3600.0))
        await store.put(name, Entry(b"", v.tobytes(), "", scope), ttl_s=3600)
        if len(batch) == 1000:  # as a rebuild from Redis adds them
            index.add_many(batch)
            batch = []
    index.add_many(batch)
    fill_s = time.perf_counter() - started
    times, search_times, cpu_times = [], [], []
    for i in range(lookups):
        text = QUERIES[i % len(QUERIES)] + f" ({i})"  # distinct: no embedding memo
        req = Request("bench", "m", Prompt(messages=(system, Message("user", text))), Sampling(temperature=0.0))
        start, cpu = time.perf_counter(), time.process_time()
        await cache.lookup(req)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
        vector = embedder.encode(text)
        start = time.perf_counter()
        index.search(scope, text, vector, 0.85)
        search_times.append(time.perf_counter() - start)
    return {"lookup_with_embedding": _ms(times), "lookup_with_embedding_cpu": _ms(cpu_times),
            "search_only": _ms(search_times), "fill_s": round(fill_s, 1)}


# --- quality on the labelled pairs: thresholds chosen on dev, figures on held-out -------------
def load_pairs(data: Path = DATA) -> tuple[dict, list[dict]]:
    """The development and held-out pairs, each with its cosine (``sim``) and the guards' refusal."""
    files, rows = load_split(data)
    return files, rows


def _embed(embedder: MiniLM, rows: list[dict]) -> list[dict]:
    for r in rows:
        r["sim"] = float(embedder.encode(r["a"]) @ embedder.encode(r["b"]))
        r["guard"] = refusal(extract(r["a"]), extract(r["b"]))
    return rows


def bench_quality(embedder: MiniLM, threshold: float, data: Path = DATA) -> dict:
    files, rows = load_pairs(data)
    _embed(embedder, rows)
    dev = [r for r in rows if r["split"] == "dev"]
    out: dict = {"default_threshold": threshold, **split_report(files, rows, at_threshold, threshold)}
    cosine = split_report(files, rows, lambda t: at_threshold(t, False), threshold)
    out["cosine_only"] = {"calibration": cosine["calibration"], "goals": cosine["goals"],
                          "heldout_at_calibrated": (cosine["heldout_at_calibrated"] or {}).get("all")}
    out["dev_refusals_by_guard"] = {g: sum(1 for r in dev if r["guard"] == g and not r["hit"])
                                    for g in sorted({r["guard"] for r in dev if r["guard"]})}
    out["dev_sweep_with_guards"] = {f"{t:.2f}": score(dev, at_threshold(t)) for t in (0.7, 0.75, 0.8, 0.85, 0.9)}
    return out


# --- the verifier on the labelled pairs ------------------------------------------------------
async def _judge_pairs(rows: list[dict], verifier: CacheVerifier) -> None:
    """Each candidate pair (cosine at or above the verifier's threshold, no guard refusal) put to
    the judge as the cache puts it: r["judge"] is yes/no/timeout/error, r["judge_s"] its time."""
    judge = HttpJudge(EmbedderSecrets())
    try:
        for r in rows:
            if r["sim"] < verifier.candidate_threshold or r["guard"] is not None:
                continue
            start = time.perf_counter()
            try:
                same = await asyncio.wait_for(judge(verifier, r["a"], r["b"]), verifier.timeout_s)
                r["judge"] = "yes" if same else "no"
            except TimeoutError:
                r["judge"] = "timeout"
            except Exception:  # noqa: BLE001 - counted, as the cache counts it
                r["judge"] = "error"
            r["judge_s"] = time.perf_counter() - start
    finally:
        await judge.close()


def _verified(rows: list[dict]) -> dict:
    s = score(rows, lambda r: r.get("judge") == "yes")
    return {"pairs": s["pairs"], "recall": s["recall"], "false_hit_rate": s["false_hit_rate"],
            "precision": s["precision"], "candidates": sum("judge" in r for r in rows)}


def judged_at(t: float):
    """The cache with its verifier: cosine at the candidate threshold ``t``, no guard refusal, the judge's yes."""
    return lambda r: r["sim"] >= t and r["guard"] is None and r.get("judge") == "yes"


def bench_verifier(embedder: MiniLM, verifier: CacheVerifier, data: Path = DATA) -> dict:
    """The pairs as the cache with its verifier sees them: cosine, guards, then the judge. Every pair at
    or over the candidate floor is judged once; the candidate threshold is then chosen on dev."""
    files, rows = load_pairs(data)
    _embed(embedder, rows)
    note(f"verifier: judging the candidates with {verifier.model} at {verifier.base_url}")
    asyncio.run(_judge_pairs(rows, verifier))
    times = [r["judge_s"] for r in rows if "judge_s" in r]
    floor = verifier.candidate_threshold
    out: dict = {"model": verifier.model, "candidate_floor": floor,
                 "timeout_s": verifier.timeout_s, "judge_latency": _ms(times) if times else None,
                 "verdicts": {v: sum(r.get("judge") == v for r in rows) for v in ("yes", "no", "timeout", "error")},
                 "dev_at_floor": _verified([r for r in rows if r["split"] == "dev"])}
    grid = [t for t in GRID if t >= floor - 1e-9]
    out.update(split_report(files, rows, judged_at, floor, grid))
    return out


@contextmanager
def judge_mesh() -> Iterator[str]:
    """llmesh's own gateway and llama.cpp engine (SmolLM2) as the judge: its /v1 URL."""
    from llmesh.testing import Mesh, free_layout

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "llmesh.yaml").write_text("cache: {enabled: false}\n")  # every judgement is asked
        mesh = Mesh(layout=free_layout(1), engines="llamacpp", model_dir=(ROOT / "var" / "models").resolve(),
                    log_dir=Path(tmp) / "logs", env={"LLMESH_CONFIG_FILE": str(Path(tmp) / "llmesh.yaml")})
        try:
            note("judge: starting a mesh (llama.cpp engine) as the judge")
            mesh.start()
            url = mesh.layout.http_url + "/v1"
            _wait_served(url, SMOL)
            yield url
        finally:
            mesh.stop()


def _wait_served(url: str, model: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if model in httpx.get(url + "/models", timeout=2).text:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{model} was not served at {url}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--hits", type=int, default=200)
    parser.add_argument("--engine-runs", type=int, default=10)
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--lookups", type=int, default=100)
    parser.add_argument("--parts", default="quality,semantic,exact",
                        help="which parts to run: quality, verifier, latency, stream, semantic, exact")
    parser.add_argument("--data", type=Path, default=DATA, help="the labelled pair files (dev and held-out)")
    parser.add_argument("--keep-logs", type=Path, help="copy the mesh's logs here")
    parser.add_argument("--engine", choices=("llamacpp", "sim"), default="llamacpp",
                        help="the engine behind the gateway for the exact-hit and stream parts")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "var" / "models" / "all-minilm-l6-v2")
    parser.add_argument("--judge-url", help="verifier and latency parts: an OpenAI-compatible /v1 (default: a "
                                            "mesh of llmesh's own with the llama.cpp engine and SmolLM2)")
    parser.add_argument("--judge-model", default=SMOL)
    parser.add_argument("--judge-threshold", type=float, default=CacheVerifier().candidate_threshold)
    parser.add_argument("--judge-timeout", type=float, default=5.0,
                        help="per judgement in the verifier part (quality first; the latency part keeps the "
                             "shipped default)")
    parser.add_argument("--latency-lookups", type=int, default=100, help="near-miss lookups, half each way")
    parser.add_argument("--stream-requests", type=int, default=300, help="after the base set")
    parser.add_argument("--stream-misses", type=int, default=24, help="fresh questions timed, cache on and off")
    return parser


def _verifier_parts(args: argparse.Namespace, parts: list[str], result: dict) -> None:
    if "verifier" not in parts and "latency" not in parts:
        return
    with nullcontext(args.judge_url) if args.judge_url else judge_mesh() as url:
        model = args.judge_model if args.judge_url else SMOL
        if "verifier" in parts:
            verifier = CacheVerifier(enabled=True, base_url=url, model=model,
                                     candidate_threshold=args.judge_threshold, timeout_s=args.judge_timeout)
            result["verifier"] = bench_verifier(args.embedder, verifier, args.data)
        if "latency" in parts:
            verifier = CacheVerifier(enabled=True, base_url=url, model=model, candidate_threshold=args.judge_threshold)
            calibrated = result.get("quality", {}).get("calibration", {}).get("threshold")
            note(f"latency: semantic threshold {calibrated or 'the default'}")
            result["lookup_latency"] = bench_latency(args.model_dir, verifier, args.data, args.latency_lookups,
                                                     calibrated)


def main() -> None:
    args = _parser().parse_args()
    embedder = args.embedder = MiniLM(args.model_dir)
    threshold = MeshConfig().cache.semantic_threshold
    result: dict = {"bench": "cache", "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    parts = args.parts.split(",")
    if "quality" in parts:
        note("quality: labelled pairs")
        result["quality"] = bench_quality(embedder, threshold, args.data)
    _verifier_parts(args, parts, result)
    if "stream" in parts:
        result["stream"] = bench_stream(args.data, args.engine, args.stream_requests, args.stream_misses,
                                        ROOT / "var" / "models")
    if "semantic" in parts:
        result["semantic_lookup"] = bench_semantic(embedder, [int(s) for s in args.sizes.split(",")], args.lookups)
    if "exact" in parts:
        result["exact_hit"] = bench_exact(args.hits, args.engine_runs, args.engine, args.keep_logs)
    result["load_average_end"] = os.getloadavg()
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

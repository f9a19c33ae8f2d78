"""``python -m bench.dynamo_replay``: an external reference for the routing bench (issue 32):
NVIDIA Dynamo's offline router replay of a trace, its ``kv_router`` against its
``round_robin``, on its mock vLLM engines (a virtual clock, no GPU).

Dynamo lives in ``.venv-dynamo`` (``make bench-tools`` / ``make dynamo-tools``), never in the
main venv: :func:`replay` writes the trace as Mooncake-style JSONL (one request a line:
``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``, one id per block of
``block_size`` tokens, shared ids meaning shared prefix blocks) and runs this same file with
``.venv-dynamo``'s interpreter (``--inner``), which calls ``dynamo.replay.run_trace_replay``
once per router mode and prints the summaries. This module imports only the standard library
at its top, so that interpreter can run it without llmesh installed.

    python -m bench.dynamo_replay --demo --json          a shared-prefix trace generated here
    python -m bench.dynamo_replay --trace FILE --json    a Mooncake-style JSONL trace

Figures: TTFT p50/p99/mean (ms, simulated time) and the prefix-cache reuse for each mode, the
ratios round_robin / kv_router (above 1: the KV router is faster), the replay's wall time.
Dynamo's KV router breaks ties between equally good workers at random, so two runs of one
trace may differ a little."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
MODES = ("kv_router", "round_robin")
BLOCK_SIZE = 64  # tokens per trace block (the mock engine's KV block too)
SKIPPED = {"skipped": "make bench-tools not run"}
# The summary's keys kept per mode, under their names here.
KEPT = {"median_ttft_ms": "ttft_p50_ms", "p99_ttft_ms": "ttft_p99_ms", "mean_ttft_ms": "ttft_mean_ms",
        "prefix_cache_reused_ratio": "prefix_reuse", "completed_requests": "completed",
        "duration_ms": "sim_duration_ms", "wall_time_ms": "dynamo_wall_ms"}


def _field(request: Any, name: str) -> Any:
    return request[name] if isinstance(request, Mapping) else getattr(request, name)


def to_trace(requests: Iterable[Any], block_size: int = BLOCK_SIZE) -> list[dict[str, Any]]:
    """A generated workload as a Mooncake-style trace, sorted by arrival.

    Each request (a mapping or an object) has ``arrival_s`` (seconds from the run's start),
    ``block_hashes`` (hashable ids of its prompt's blocks of ``block_size`` tokens, chained so
    that equal ids mean an equal prefix, as ``llmesh.kvhash.chain_hashes`` gives them),
    ``input_tokens`` and ``output_tokens``. The hashes become small integers numbered in order
    of first appearance (shared blocks keep one id). Hashes of full blocks only (a partial last
    block left out, as ``chain_hashes`` does) get a fresh id for that block; any other count
    of blocks is refused."""
    ids: dict[Any, int] = {}
    rows = []
    for request in requests:
        input_tokens, output_tokens = int(_field(request, "input_tokens")), int(_field(request, "output_tokens"))
        if input_tokens < 1 or output_tokens < 1:
            raise ValueError(f"a request needs input and output tokens, got {input_tokens} and {output_tokens}")
        blocks = [ids.setdefault(h, len(ids)) for h in _field(request, "block_hashes")]
        need = math.ceil(input_tokens / block_size)
        if len(blocks) == need - 1 and input_tokens % block_size:
            blocks.append(ids.setdefault(object(), len(ids)))  # the partial last block: its own id
        elif len(blocks) != need:
            raise ValueError(f"{len(blocks)} block hashes for {input_tokens} tokens in blocks of {block_size}")
        rows.append((float(_field(request, "arrival_s")), blocks, input_tokens, output_tokens))
    trace = []
    for arrival_s, blocks, input_tokens, output_tokens in sorted(rows, key=lambda row: row[0]):
        trace.append({"timestamp": round(arrival_s * 1000.0, 3), "input_length": input_tokens,
                      "output_length": output_tokens, "hash_ids": blocks})
    return trace


def from_tokens(arrival_s: float, tokens: Sequence[int], output_tokens: int,
                block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """One request for :func:`to_trace` from its prompt's token ids: the blocks hashed with
    llmesh's own chained scheme (``llmesh.kvhash.chain_hashes``), so prompts that share a
    prefix of whole blocks share those ids. Main venv only (it imports llmesh)."""
    from llmesh.kvhash import chain_hashes

    return {"arrival_s": arrival_s, "block_hashes": chain_hashes(tokens, block_size),
            "input_tokens": len(tokens), "output_tokens": output_tokens}


def demo_requests(n: int = 800, rate: float = 40.0, groups: int = 16, prefix_blocks: int = 48,
                  own_blocks: int = 4, output_tokens: int = 64, block_size: int = BLOCK_SIZE,
                  seed: int = 1) -> list[dict[str, Any]]:
    """A shared-prefix workload: each request picks one of ``groups`` long common prefixes
    (``prefix_blocks`` blocks: a system prompt) and adds ``own_blocks`` of its own; Poisson
    arrivals at ``rate`` per second."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for i in range(n):
        at += rng.expovariate(rate)
        group = rng.randrange(groups)
        hashes = [("prefix", group, b) for b in range(prefix_blocks)] + [("own", i, b) for b in range(own_blocks)]
        out.append({"arrival_s": at, "block_hashes": hashes,
                    "input_tokens": (prefix_blocks + own_blocks) * block_size, "output_tokens": output_tokens})
    return out


# The demo's mock engines: KV room for about 800 blocks each, so the 16 prefixes (768 blocks)
# do not all fit beside the running requests on one worker (round robin sends each worker all
# of them) while a quarter of them do (what a KV-aware router can keep on each).
DEMO_ENGINE = {"num_gpu_blocks": 800}


def _round(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def summarize(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per mode the kept figures (and the second half's ``window``, where the replay counted it);
    ``ratios``: round_robin / kv_router for each TTFT figure, where both modes ran."""
    out: dict[str, Any] = {mode: {KEPT[k]: _round(s[k]) for k in KEPT if k in s} for mode, s in summaries.items()}
    for mode, s in summaries.items():
        if "window" in s:
            out[mode]["window"] = dict(s["window"])
    if "kv_router" in out and "round_robin" in out:
        kv, rr = out["kv_router"], out["round_robin"]
        out["ratios"] = {f"{stat}_rr_over_kv": _ratio(rr[stat], kv[stat])
                         for stat in ("ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms")}
    return out


def second_half(requests: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Of a replay's requests (``arrival_time_ms``, ``terminal_time_ms``), how many arrived and how
    many finished in the second half of the arrival window, as ``bench.routing_sweep`` counts a
    sim run's: whether the workers keep up with arrivals there (``routing_sweep.keeps_up``)."""
    rows = [(float(r["arrival_time_ms"]), r.get("terminal_time_ms")) for r in requests]
    span = max((a for a, _ in rows), default=0.0)
    lo, hi = span / 2, span
    return {"came": sum(lo <= a < hi for a, _ in rows),
            "done": sum(t is not None and lo <= float(t) < hi for _, t in rows)}


def replay(trace: list[dict[str, Any]], workers: int = 4, block_size: int = BLOCK_SIZE,
           engine: Mapping[str, Any] | None = None, timeout_s: float = 600.0,
           python: Path = DYNAMO_PYTHON, modes: Sequence[str] = MODES, speedup: float = 1.0) -> dict[str, Any]:
    """Dynamo's offline replay of ``trace`` (:func:`to_trace`'s rows) on ``workers`` mock vLLM
    workers, once in each of ``modes`` (``kv_router``, ``round_robin``). ``engine``: more of the
    mock engine's settings (``num_gpu_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``speedup_ratio``...); ``block_size`` is both the trace's and the engine's; ``speedup``
    divides the arrival times (Dynamo's ``arrival_speedup_ratio``: 2 offers twice the rate).
    Returns :func:`summarize`'s figures plus ``wall_s`` (the subprocess, every mode), or
    ``{"skipped": ...}`` where ``.venv-dynamo`` is missing. Raises RuntimeError when the
    replay fails."""
    if not python.is_file():
        return dict(SKIPPED)
    if not trace:
        raise ValueError("an empty trace")
    if not modes or any(m not in MODES for m in modes) or not speedup > 0:
        raise ValueError(f"modes among {MODES} and a positive speedup, got {modes} and {speedup}")
    config = {"workers": workers, "block_size": block_size, "engine": dict(engine or {}), "modes": list(modes),
              "speedup": speedup}
    with tempfile.TemporaryDirectory(prefix="dynamo-replay-") as tmp:
        path = Path(tmp) / "trace.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in trace))
        started = time.perf_counter()
        done = subprocess.run([str(python), str(Path(__file__).resolve()), "--inner", str(path), json.dumps(config)],
                              capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "DYN_LOG": os.environ.get("DYN_LOG", "warn")})
        wall_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"Dynamo's replay failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    out = summarize(json.loads(done.stdout))
    out.update(requests=len(trace), workers=workers, block_size=block_size, engine=config["engine"],
               speedup=speedup, wall_s=round(wall_s, 3))
    return out


def saturation(trace: list[dict[str, Any]], keeps_up: Callable[..., bool], mode: str = "round_robin",
               start: float = 1.0, bisect: int = 4, **replay_args: Any) -> dict[str, Any]:
    """The highest ``speedup`` of ``trace`` that ``mode`` keeps up with on Dynamo's mock workers
    (``keeps_up(came, done)`` over each replay's second half: the sim's rule), by ``bench.saturation.highest``.
    ``{"skipped": ...}`` without ``.venv-dynamo``."""
    from bench.saturation import highest  # here, not at the top: .venv-dynamo runs this file without llmesh

    if not replay_args.get("python", DYNAMO_PYTHON).is_file():
        return dict(SKIPPED)

    def probe(speedup: float) -> tuple[bool, dict[str, Any]]:
        run = replay(trace, modes=(mode,), speedup=speedup, **replay_args)
        return keeps_up(**run[mode]["window"]), run[mode]

    speedup, run, probes = highest(probe, start, bisect)
    return {"mode": mode, "speedup": round(speedup, 4), "probes": probes, "window": run["window"],
            "ttft_p50_ms": run.get("ttft_p50_ms")}


def _inner(trace_path: str, config_json: str) -> int:
    """In ``.venv-dynamo``: each mode asked for over one trace file, their summaries (with each one's
    ``second_half`` window) as JSON on stdout."""
    from dynamo.replay import run_trace_replay  # type: ignore[import-not-found]  # .venv-dynamo only

    config = json.loads(config_json)
    engine = {"block_size": config["block_size"], "enable_prefix_caching": True, **config["engine"]}
    summaries = {}
    for mode in config.get("modes", MODES):
        report = run_trace_replay([trace_path], num_workers=config["workers"], router_mode=mode,
                                  trace_block_size=config["block_size"], extra_engine_args={"engine": engine},
                                  arrival_speedup_ratio=config.get("speedup", 1.0), capture_per_request=True)
        summaries[mode] = {**report.summary, "window": second_half(report.per_request)}
    print(json.dumps(summaries))
    return 0


def read_trace(path: Path) -> list[dict[str, Any]]:
    """A Mooncake-style JSONL trace file (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--inner"]:
        return _inner(argv[1], argv[2])
    parser = argparse.ArgumentParser(prog="python -m bench.dynamo_replay", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="a Mooncake-style JSONL trace")
    source.add_argument("--demo", action="store_true", help="a shared-prefix trace generated here")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--num-gpu-blocks", type=int, help="KV blocks per mock worker (the demo: 800)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout (the default prints it too)")
    args = parser.parse_args(argv)
    engine: dict[str, Any] = {}
    if args.demo:
        trace = to_trace(demo_requests(block_size=args.block_size), args.block_size)
        engine.update(DEMO_ENGINE)
    else:
        trace = read_trace(args.trace)
    if args.num_gpu_blocks:
        engine["num_gpu_blocks"] = args.num_gpu_blocks
    out = replay(trace, workers=args.workers, block_size=args.block_size, engine=engine)
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

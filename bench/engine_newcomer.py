"""A request that arrives while others decode, on the llama.cpp engine: its time to first token and
the others' time between tokens (``python -m bench.engine_newcomer --json``).

The llama.cpp backend runs in this process on the real model (SmolLM2-135M, 2 threads, 4 slots). Each
repetition starts ``--decoding`` long answers, lets them decode for a second and a half, then asks a
newcomer whose system prompt is cached and whose question (~15 tokens) is not: its TTFT is the step in
progress, then its own prefill (the engine decodes prompt chunks in a call of their own, before the
decoding sequences' tokens; docs/benchmarks.md has the step costs that make this pay on a CPU).
Reports the newcomer's TTFT p50 and each repetition's, and the decoding sequences' gap between
tokens p50 over the whole run."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from contextlib import aclosing
from pathlib import Path

from llmesh.engine.backends.base import DecodeParams
from llmesh.engine.backends.llamacpp import LlamaCppBackend
from llmesh.types import Message, Prompt
from bench.common import note
from bench.engine import MODEL, SYSTEM  # bench.engine's model and long shared system prompt


async def measure(backend: LlamaCppBackend, reps: int, decoding: int) -> dict:
    def prompt(question: str) -> list[int]:
        return backend.tokenize(Prompt(messages=(Message("system", SYSTEM), Message("user", question))))

    gaps: list[float] = []

    async def long_answer(seed: int) -> None:
        last = None
        async with aclosing(backend.stream(prompt(f"Tell me a long story about ship {seed}."),
                                           DecodeParams(400, 0.0, 1.0, seed))) as stream:
            async for _ in stream:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now

    async with aclosing(backend.stream(prompt("hi"), DecodeParams(2, 0.0, 1.0, 0))) as stream:
        async for _ in stream:  # the system prompt cached in a slot, the first-call allocations done
            pass
    ttfts: list[float] = []
    for rep in range(reps):
        others = [asyncio.create_task(long_answer(rep * 10 + i)) for i in range(decoding)]
        await asyncio.sleep(1.5)
        asked = time.perf_counter()
        async with aclosing(backend.stream(prompt(f"Which shelf has books about {rep} dragons and their keepers?"),
                                           DecodeParams(1, 0.0, 1.0, 0))) as stream:
            async for _ in stream:
                ttfts.append((time.perf_counter() - asked) * 1000)
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await asyncio.sleep(0.2)
        note(f"engine_newcomer: repetition {rep + 1}/{reps}: TTFT {ttfts[-1]:.1f} ms")
    return {"newcomer_ttft_ms_p50": round(statistics.median(ttfts), 1),
            "newcomer_ttft_ms": [round(t, 1) for t in ttfts],
            "decoding_gap_ms_p50": round(statistics.median(gaps) * 1000, 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_newcomer", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--decoding", type=int, default=3, help="sequences decoding when the newcomer arrives")
    ap.add_argument("--model-dir", type=Path, default=Path("var/models"))
    args = ap.parse_args(argv)
    backend = LlamaCppBackend.from_store(args.model_dir, MODEL, n_ctx=2048, n_threads=2, n_batch=512,
                                         n_slots=args.decoding + 1)

    async def run() -> dict:
        try:
            return await measure(backend, args.reps, args.decoding)
        finally:
            await backend.close()

    result = asyncio.run(run())
    print(json.dumps({"bench": "engine_newcomer", "model": MODEL, "threads": 2, "decoding": args.decoding,
                      "reps": args.reps, **result}, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

"""What tokenizing a prompt in the gateway costs its event loop: the real tokenizers the gateway
counts and picks with (llama.cpp's, from SmolLM2's GGUF in the model store; a Hugging Face
folder's when one is there: ``make vllm-model``'s SmolLM2), on chats of growing length.

Per tokenizer and length (a lone question, chats of 12 messages, then an embeddings request of
``--inputs`` short texts, as the token limits count them), ``--requests`` requests arrive at once on
one event loop, as the gateway's limits and picks meet them, while a ticker on the same loop asks to
wake every millisecond:

- ``inline``: each tokenized on the loop, as the gateway did before ``PromptTokens.ahead`` (and the
  embeddings inputs, each too short for a thread alone, before ``ahead`` took them together);
- ``ahead``: each through ``PromptTokens.ahead`` (a thread when ``worth_a_thread``, else inline).

Reported: the prompt's tokens, one tokenization's median time, and per mode the loop's longest
stall (the ticker's worst lateness) and p99, and the wall time until every request had its tokens.

    python -m bench.prompt_tokens [--json] [--requests 8] [--rounds 5] [--inputs 2048]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from bench.common import note, pct
from llmesh.gateway.domain.prompt_tokens import AHEAD_CHARS, PromptTokens, worth_a_thread
from llmesh.types import Message, Prompt

ROOT = Path(__file__).resolve().parent.parent
GGUF_STORE, GGUF_MODEL = ROOT / "var" / "models", "smollm2-135m-instruct"
HF_FOLDER = Path.home() / ".cache" / "llmesh" / "models" / "smollm2-135m-instruct-hf-fp32"  # make vllm-model
QUESTION = Prompt(messages=(Message("user", "What is 2 + 2?"),))
WORDS = 100, 600, 2_400, 9_600, 38_400  # 12-message chats (a system prompt and 10 turns): ~200 to ~42k tokens


def chat(words: int, rng: random.Random) -> Prompt:
    vocab = ("the harbour boats tides morning report engine cache request answer token model gateway "
             "latency stream queue budget tenant policy, fleet. route").split()
    turns = [Message("system", " ".join(rng.choice(vocab) for _ in range(words // 2)))]
    for i in range(10):
        turns.append(Message("user" if i % 2 == 0 else "assistant",
                             " ".join(rng.choice(vocab) for _ in range(words // 20))))
    return Prompt(messages=(*turns, Message("user", "And what now?")))


def inputs(n: int) -> list[Prompt]:
    """An embeddings request's ``n`` inputs of ~470 characters each: each under ``AHEAD_CHARS``."""
    return [Prompt(text=f"document {i}: " + "the harbour, the boats and the tides of the northern sea " * 8)
            for i in range(n)]


async def served(tokens: PromptTokens, model: str, prompts: list[Prompt], requests: int, ahead: bool) -> dict:
    """``requests`` requests for ``prompts``' tokens at once, with a 1 ms ticker on the loop."""
    late: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            asked = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append(time.perf_counter() - asked - 0.001)

    async def one() -> int:
        await asyncio.sleep(0)
        ids = await tokens.ahead(model, prompts) if ahead else None
        return sum(map(len, ids if ids is not None else [tokens(model, p) for p in prompts]))

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.005)
    start = time.perf_counter()
    counts = await asyncio.gather(*(one() for _ in range(requests)))
    wall = time.perf_counter() - start
    done.set()
    await tick
    assert len(set(counts)) == 1
    return {"loop_stall_ms_max": round(max(late) * 1000, 2), "loop_stall_ms_p99": round(pct(late, 99) * 1000, 2),
            "wall_ms": round(wall * 1000, 1)}


async def measure(tokens: PromptTokens, model: str, requests: int, rounds: int, n_inputs: int) -> list[dict]:
    rng, rows = random.Random(7), []
    tokens(model, chat(20, rng))  # loads the vocabulary
    for prompts in ([QUESTION], *([chat(words, rng)] for words in WORDS), inputs(n_inputs)):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            n = sum(len(tokens(model, p)) for p in prompts)
            times.append(time.perf_counter() - start)
        texts = [m.content for p in prompts for m in p.messages] if prompts[0].messages else [p.text for p in prompts]
        row = {"kind": "chat" if prompts[0].messages else "embeddings", "inputs": len(prompts),
               "messages": sum(len(p.messages or ()) for p in prompts), "prompt_chars": sum(map(len, texts)),
               "prompt_tokens": n, "tokenize_ms_p50": round(statistics.median(times) * 1000, 2),
               "worth_a_thread": worth_a_thread(prompts)}
        for mode in ("inline", "ahead"):
            runs = [await served(tokens, model, prompts, requests, mode == "ahead") for _ in range(rounds)]
            row[mode] = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
        note(f"prompt_tokens: {model} {n} tokens: {row}")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.prompt_tokens", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the JSON document only (the default prints it too)")
    ap.add_argument("--requests", type=int, default=8, help="requests that arrive together (default 8)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per cell; medians are reported (default 5)")
    ap.add_argument("--inputs", type=int, default=2048, help="the embeddings request's inputs (default 2048)")
    args = ap.parse_args(argv)
    found = {"gguf": (GGUF_STORE, GGUF_MODEL) if (GGUF_STORE / GGUF_MODEL / "model.json").is_file() else None,
             "hf": (HF_FOLDER.parent, HF_FOLDER.name) if (HF_FOLDER / "tokenizer.json").is_file() else None}
    out: dict = {"bench": "prompt_tokens", "ahead_chars": AHEAD_CHARS, "requests": args.requests,
                 "rounds": args.rounds, "inputs": args.inputs, "tokenizers": {}}
    for kind, where in found.items():
        if where is None:
            out["tokenizers"][kind] = None
            continue
        tokens = PromptTokens(where[0])
        try:
            out["tokenizers"][kind] = {"model": where[1],
                                       "cells": asyncio.run(measure(tokens, where[1], args.requests, args.rounds,
                                                                          args.inputs))}
        finally:
            tokens.close()
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

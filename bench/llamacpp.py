"""Single-stream speed of the llama.cpp engine through the whole mesh, next to raw
``llama_cpp.Llama`` on the same model, prompt and greedy sampling, in one run.

    python -m bench.llamacpp [--tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import signal
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from openai import OpenAI

from llmesh.engine.backends.llamacpp import LlamaCppBackend
from llmesh.rpc.channels import insecure_channel
from llmesh.testing import Mesh, free_layout
from llmesh.types import Message, Prompt
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from bench.common import note

MODEL = "smollm2-135m-instruct"
QUESTION = "Write a long story about a dragon who learns to fly."


def rates(stamps: list[float], start: float) -> dict:
    """Decode rate over the tokens after the first, and the whole request's rate."""
    return {"tokens": len(stamps), "ttft_ms": (stamps[0] - start) * 1000,
            "decode_tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "overall_tokens_per_s": len(stamps) / (stamps[-1] - start)}


def summarise(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}


def raw_llama(model_dir: Path, n_tokens: int, runs: int, n_ctx: int, threads: int) -> dict:
    backend = LlamaCppBackend.from_store(model_dir, MODEL, n_ctx=n_ctx, n_threads=threads, n_batch=512)
    llm = backend._llm  # the same Llama object an engine would hold, driven directly
    tokens = backend.tokenize(Prompt(messages=(Message("user", QUESTION),)))
    out = []
    for _ in range(runs):
        # Like the engine, generate() keeps the KV cache of the prompt prefix between runs.
        start = time.perf_counter()
        stamps = []
        for tok in llm.generate(tokens, temp=0.0, top_k=0, min_p=0.0, top_p=1.0, repeat_penalty=1.0):
            if tok == llm.token_eos():
                break
            stamps.append(time.perf_counter())
            if len(stamps) >= n_tokens:
                break
        out.append(rates(stamps, start))
    llm.close()
    return summarise(out)


def through_gateway(mesh: Mesh, n_tokens: int, runs: int) -> dict:
    client = OpenAI(base_url=mesh.layout.http_url + "/v1", api_key="unused", max_retries=0)
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        stamps = []
        for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                    temperature=0, max_tokens=n_tokens, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
        out.append(rates(stamps, start))
    return summarise(out)


async def straight_to_engine(address: str, n_tokens: int, runs: int) -> dict:
    out = []
    async with insecure_channel(address) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        for _ in range(runs):
            req = engine_pb2.GenerateRequest(
                model=MODEL, chat=engine_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content=QUESTION)]),
                sampling=common_pb2.SamplingParams(max_tokens=n_tokens, temperature=0.0))
            start = time.perf_counter()
            stamps = []
            async for resp in stub.Generate(req, timeout=120):
                if resp.text:
                    stamps.append(time.perf_counter())
            out.append(rates(stamps, start))
    return summarise(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model-dir", type=Path, default=Path("var/models"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    n_ctx = 2048
    note("raw llama_cpp.Llama …")
    raw = raw_llama(args.model_dir, args.tokens, args.runs, n_ctx, args.threads)
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        mesh = Mesh(layout=free_layout(1), engines="llamacpp", model_dir=args.model_dir.resolve(),
                    log_dir=Path(tmp), env={"LLMESH_ENGINE_N_CTX": str(n_ctx),
                                            "LLMESH_ENGINE_N_THREADS": str(args.threads),
                                            }, args=["--no-cache"])
        mesh.start()
        try:
            note("through the gateway (OpenAI streaming) …")
            gateway = through_gateway(mesh, args.tokens, args.runs)
            note("straight to the engine over gRPC …")
            engine = asyncio.run(straight_to_engine(mesh.layout.engine_address(0), args.tokens, args.runs))
        finally:
            mesh.stop(signal.SIGINT)
    print(json.dumps({
        "bench": "llamacpp_single_stream", "model": MODEL, "max_tokens": args.tokens, "runs": args.runs,
        "threads": args.threads, "raw_llama_cpp": raw, "engine_grpc": engine, "gateway_http": gateway,
        "ratio_gateway_vs_raw_decode": round(gateway["decode_tokens_per_s"] / raw["decode_tokens_per_s"], 3),
        "ratio_gateway_vs_raw_overall": round(gateway["overall_tokens_per_s"] / raw["overall_tokens_per_s"], 3),
        "ratio_engine_vs_raw_decode": round(engine["decode_tokens_per_s"] / raw["decode_tokens_per_s"], 3),
    }, indent=2))


if __name__ == "__main__":
    main()

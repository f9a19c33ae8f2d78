"""Single-stream speed of the llama.cpp engine through the whole mesh, next to raw
``llama_cpp.Llama`` on the same model, prompt and greedy sampling, in one run.

    python -m bench.llamacpp [--tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from llmesh.modelstore import ModelStore, quiet_native_stderr
from llmesh.testing import Mesh, free_layout
from bench.common import note
from bench.engine import Engine

MODEL = "smollm2-135m-instruct"
QUESTION = "Write a long story about a dragon who learns to fly."


def rates(tokens: int, stamps: list[float], start: float) -> dict:
    """Decode rate over the tokens after the first, and the whole request's rate.
    ``stamps`` are arrival times of chunks; a chunk may carry several tokens when a
    hop coalesced them, so the token count comes from usage, not from len(stamps)."""
    return {"tokens": tokens, "ttft_ms": (stamps[0] - start) * 1000,
            "decode_tokens_per_s": (tokens - 1) / (stamps[-1] - stamps[0]),
            "overall_tokens_per_s": tokens / (stamps[-1] - start)}


def summarise(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}


class RawLlama:
    """Plain ``llama_cpp.Llama`` on the same model file, fed the engine's prompt
    tokens (chat template applied) with greedy sampling."""

    def __init__(self, model_dir: Path, n_ctx: int, threads: int):
        from llama_cpp import Llama

        record = ModelStore(model_dir).get(MODEL)
        with quiet_native_stderr():
            self.llm = Llama(model_path=str(record.path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                             n_batch=512, verbose=False)
        template = Jinja2ChatFormatter(template=self.llm.metadata["tokenizer.chat_template"], eos_token="",
                                       bos_token="")
        text = template(messages=[{"role": "user", "content": QUESTION}]).prompt
        self.tokens = self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def run(self, n_tokens: int) -> dict:
        llm = self.llm
        start = time.perf_counter()
        stamps = []
        # Like the engine, generate() keeps the KV cache of the prompt prefix between runs.
        for tok in llm.generate(self.tokens, temp=0.0, top_k=0, min_p=0.0, top_p=1.0, repeat_penalty=1.0):
            if tok == llm.token_eos():
                break
            stamps.append(time.perf_counter())
            if len(stamps) >= n_tokens:
                break
        return rates(len(stamps), stamps, start)


def through_gateway(client: OpenAI, n_tokens: int) -> dict:
    start = time.perf_counter()
    stamps, tokens = [], 0
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                temperature=0, max_tokens=n_tokens, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return rates(tokens, stamps, start)


async def straight_to_engine(address: str, n_tokens: int) -> dict:
    s = await Engine(address).one([{"role": "user", "content": QUESTION}], n_tokens)
    return {"tokens": s.tokens, "ttft_ms": s.ttft_s * 1000,
            "decode_tokens_per_s": (s.tokens - 1) / (s.total_s - s.ttft_s),
            "overall_tokens_per_s": s.tokens / s.total_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=8, help="interleaved rounds")
    parser.add_argument("--model-dir", type=Path, default=Path("var/models"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    n_ctx = 2048
    with tempfile.TemporaryDirectory() as tmp:
        mesh = Mesh(layout=free_layout(1), engines="llamacpp", model_dir=args.model_dir.resolve(), log_dir=Path(tmp),
                    env={"LLMESH_ENGINE_N_CTX": str(n_ctx), "LLMESH_ENGINE_N_THREADS": str(args.threads)},
                    args=["--no-cache"])
        mesh.start()
        try:
            raw = RawLlama(args.model_dir, n_ctx, args.threads)
            client = OpenAI(base_url=mesh.layout.http_url + "/v1", api_key="unused", max_retries=0)
            engine_address = mesh.layout.engine_address(0)
            runs: dict[str, list[dict]] = {"raw_llama_cpp": [], "engine_grpc": [], "gateway_http": []}
            # Interleaved rounds: this machine drifts by 10-30% over a minute, so each
            # round compares the three paths under the same conditions.
            for i in range(args.runs):
                note(f"round {i + 1}/{args.runs}")
                runs["raw_llama_cpp"].append(raw.run(args.tokens))
                runs["engine_grpc"].append(asyncio.run(straight_to_engine(engine_address, args.tokens)))
                runs["gateway_http"].append(through_gateway(client, args.tokens))
        finally:
            mesh.stop(signal.SIGINT)

    def ratio(path: str, key: str) -> float:
        return round(statistics.median(p[key] / r[key] for p, r in zip(runs[path], runs["raw_llama_cpp"])), 3)

    print(json.dumps({
        "bench": "llamacpp_single_stream", "model": MODEL, "max_tokens": args.tokens, "rounds": args.runs,
        "threads": args.threads, **{path: summarise(rs) for path, rs in runs.items()},
        "ratio_gateway_vs_raw_decode": ratio("gateway_http", "decode_tokens_per_s"),
        "ratio_gateway_vs_raw_overall": ratio("gateway_http", "overall_tokens_per_s"),
        "ratio_engine_vs_raw_decode": ratio("engine_grpc", "decode_tokens_per_s"),
    }, indent=2))


if __name__ == "__main__":
    main()

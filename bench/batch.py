"""A batch's cost to interactive traffic: streamed chat requests through the gateway
(``--streams`` at once) onto a sim engine, their time to first token without a batch, then
while a batch of ``--lines`` requests runs through the Batch API on the same engine, then
without again (against drift). The goal (issue 29): the interactive p99 TTFT with the batch
within 1.5x of without. Also: the batch's wall time and counts.

    python -m bench.batch [--lines 500] [--streams 4] [--tokens 16] [--decode-ms 10] [--per-seq-ms 1]
                          [--max-running 8] [--json]

By default the engine has fewer slots (8) than the batch's lines in flight (8) and the interactive
streams (4) together, and each sequence in a step costs time: the batch competes for slots and for
step time, and must yield (with 16 free slots and steps of fixed cost it never had to).

The batch is sent with the official openai client (files.create, batches.create) and the
interactive requests over httpx, as in bench.gateway; the mesh is `llmesh up` on this machine
(local mode: the in-process queue)."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import signal
import tempfile
import time
from pathlib import Path

import httpx
import orjson
from openai import OpenAI

from llmesh.testing import Mesh, free_layout
from bench.common import note, pct, sse_call

MODEL = "sim-small"


def batch_file(lines: int, tokens: int) -> bytes:
    return b"".join(orjson.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": MODEL, "max_tokens": tokens,
                                           "messages": [{"role": "user", "content": f"summarize item {i}"}]}}) + b"\n"
                    for i in range(lines))


async def interactive(url: str, streams: int, tokens: int, until) -> list[float]:
    """TTFTs (ms) of streamed requests, ``streams`` at a time, while ``until()`` is False."""
    ttfts: list[float] = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": tokens,
            "stream": True}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=streams * 2)) as client:
        async def worker() -> None:
            while not until():
                sample = await sse_call(client, url, body)
                ttfts.append(sample.ttft_s * 1000)
        await asyncio.gather(*(worker() for _ in range(streams)))
    return ttfts


def summary(ttfts: list[float]) -> dict:
    return {"requests": len(ttfts), "ttft_ms_p50": round(pct(ttfts, 50), 2), "ttft_ms_p99": round(pct(ttfts, 99), 2)}


async def measure(base: str, args: argparse.Namespace) -> dict:
    url = base + "/v1/chat/completions"
    client = OpenAI(base_url=base + "/v1", api_key="local", max_retries=0)

    def for_s(seconds: float):
        end = time.monotonic() + seconds
        return lambda: time.monotonic() >= end
    await interactive(url, args.streams, args.tokens, for_s(2))  # warm
    before = await interactive(url, args.streams, args.tokens, for_s(args.baseline_s))
    started = time.monotonic()
    uploaded = await asyncio.to_thread(client.files.create,
                                       file=("bench.jsonl", io.BytesIO(batch_file(args.lines, args.tokens))),
                                       purpose="batch")
    batch = await asyncio.to_thread(client.batches.create, input_file_id=uploaded.id,
                                    endpoint="/v1/chat/completions", completion_window="24h")
    state = {"batch": batch}

    async def poll() -> None:
        while state["batch"].status not in ("completed", "failed", "cancelled", "expired"):
            await asyncio.sleep(0.25)
            state["batch"] = await asyncio.to_thread(client.batches.retrieve, batch.id)
    poller = asyncio.create_task(poll())
    during = await interactive(url, args.streams, args.tokens, poller.done)
    await poller
    batch_s = time.monotonic() - started
    after = await interactive(url, args.streams, args.tokens, for_s(args.baseline_s))
    done = state["batch"]
    without, with_batch = summary(before + after), summary(during)
    ratio = round(with_batch["ttft_ms_p99"] / without["ttft_ms_p99"], 3) if without["ttft_ms_p99"] else None
    note(f"interactive TTFT p99: {without['ttft_ms_p99']:.1f} ms without, {with_batch['ttft_ms_p99']:.1f} ms with "
         f"the batch ({ratio}x; goal <= 1.5x); batch {done.status} in {batch_s:.1f} s, "
         f"{done.request_counts.completed}/{done.request_counts.total} completed")
    return {"without_batch": without, "with_batch": with_batch, "p99_ratio": ratio, "goal_ratio": 1.5,
            "batch": {"status": done.status, "lines": args.lines, "completed": done.request_counts.completed,
                      "failed": done.request_counts.failed, "wall_s": round(batch_s, 2),
                      "lines_per_s": round(args.lines / batch_s, 1)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=500)
    parser.add_argument("--streams", type=int, default=4, help="interactive streams at once")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer (interactive and batch)")
    parser.add_argument("--decode-ms", type=float, default=10.0, help="sim time per decode step")
    parser.add_argument("--per-seq-ms", type=float, default=1.0, help="sim time added per sequence in a step")
    parser.add_argument("--max-running", type=int, default=8, help="the engine's slots (sequences at once)")
    parser.add_argument("--baseline-s", type=float, default=8.0, help="seconds of interactive traffic alone, "
                        "before and after the batch")
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mesh = Mesh(layout=free_layout(1), engines="sim", model_dir=Path(tmp) / "models",
                    log_dir=Path(tmp) / "logs",
                    env={"LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": str(args.decode_ms),
                         "LLMESH_ENGINE_SIM_DECODE_MS_PER_SEQ": str(args.per_seq_ms),
                         "LLMESH_ENGINE_MAX_RUNNING": str(args.max_running),
                         "LLMESH_GATEWAY_LOG_LEVEL": "warning", "LLMESH_ENGINE_LOG_LEVEL": "warning"})
        mesh.start(timeout_s=90)
        try:
            results = asyncio.run(measure(mesh.layout.http_url, args))
        finally:
            mesh.stop(signal.SIGINT)
    out = {"bench": "batch", "backend": "sim", "sim_decode_ms_per_token": args.decode_ms,
           "sim_decode_ms_per_seq": args.per_seq_ms, "max_running": args.max_running, "streams": args.streams,
           "tokens": args.tokens, "results": results}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

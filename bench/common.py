"""Shared bench plumbing: percentiles, per-process CPU time, concurrent drivers, a
streamed OpenAI call."""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from llmesh.testing import children_of

CLK_TCK = os.sysconf("SC_CLK_TCK")


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (a gateway's supervisor and its worker processes)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children_of(p))
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of ``pid`` and of its live descendants: a gateway run as
    several workers is counted whole. A descendant that exited takes its time with it."""
    total = 0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended between the listing and the read
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / CLK_TCK


def child_pid(parent: int, module: str) -> int:
    for pid in children_of(parent):
        if module in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
            return pid
    raise LookupError(module)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


@dataclass
class Sample:
    ttft_s: float
    total_s: float
    tokens: int
    messages: int = 0  # stream messages the answer came in, where the caller counts them


async def drive(one: Callable[[int], Awaitable[Sample]], concurrency: int, requests: int) -> dict:
    """Runs ``requests`` calls of ``one`` with ``concurrency`` in flight; summarises."""
    samples: list[Sample] = []
    errors = 0
    counter = iter(range(requests))

    async def worker() -> None:
        nonlocal errors
        for i in counter:
            try:
                samples.append(await one(i))
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors += 1
                if errors <= 3:
                    note(f"  error: {type(exc).__name__}: {exc}")

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ttft = [s.ttft_s * 1000 for s in samples]
    tokens = sum(s.tokens for s in samples)
    return {
        "requests": len(samples), "errors": errors, "wall_s": round(wall, 3),
        "ttft_ms_p50": round(pct(ttft, 50), 3), "ttft_ms_p99": round(pct(ttft, 99), 3),
        "ttft_ms_mean": round(statistics.fmean(ttft), 3) if ttft else None,
        "tokens_per_s": round(tokens / wall, 1),
        "per_stream_tokens_per_s":
            round(statistics.fmean(s.tokens / s.total_s for s in samples), 1) if samples else None,
    }


class SseTally:
    """One streamed (SSE) chat completion read line by line: time to the first content,
    total time, and the completion tokens of the usage chunk, or the number of chunks
    without one. Every chunk is parsed, whichever client read it."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ttft: float | None = None
        self.chunks = 0
        self.tokens: int | None = None

    def line(self, line: bytes) -> None:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            return
        chunk = orjson.loads(line[6:])
        if self.ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            self.ttft = time.perf_counter() - self.start
        if chunk.get("usage"):
            self.tokens = chunk["usage"]["completion_tokens"]
        self.chunks += 1

    def sample(self) -> Sample:
        total = time.perf_counter() - self.start
        return Sample(total if self.ttft is None else self.ttft, total,
                      self.chunks if self.tokens is None else self.tokens)


async def sse_call(client: httpx.AsyncClient, url: str, body: dict) -> Sample:
    """One streamed chat completion over httpx (:class:`SseTally`)."""
    tally = SseTally()
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            tally.line(line.encode())
    return tally.sample()

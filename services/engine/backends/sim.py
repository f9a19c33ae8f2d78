"""A simulated backend: no model, deterministic words at configured speeds.

It exists to measure the mesh's own overhead and to run many engines on one
machine. Like a batching engine, it advances every running sequence by one token
per decode step on one shared clock; a new sequence's prefill (and so its first
token) takes ``prefill_ms_per_token`` for each prompt token. Its model is always named ``sim-*`` and its
output is not language."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
from collections.abc import AsyncIterator

from llmesh.types import Prompt
from llmesh.engine.backends.base import DecodeParams

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
          "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa")


class _StepClock:
    """Wakes every waiting sequence once per decode step (one timer for all)."""

    def __init__(self, step_s: float):
        self._step = step_s
        self._waiters: list[asyncio.Future[None]] = []
        self._task: asyncio.Task | None = None

    async def tick(self) -> None:
        if self._step <= 0:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        await fut

    async def _run(self) -> None:
        while self._waiters:
            await asyncio.sleep(self._step)
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class SimBackend:
    name = "sim"

    def __init__(self, model: str, context_length: int, prefill_ms_per_token: float,
                 decode_ms_per_token: float, output_tokens: int):
        if not model.startswith("sim"):
            raise ValueError("a simulated model's name must start with 'sim'")
        self.model = model
        self.context_length = context_length
        self._prefill_s = prefill_ms_per_token / 1000.0
        self._clock = _StepClock(decode_ms_per_token / 1000.0)
        self._output_tokens = output_tokens

    def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            text = " ".join(f"{m.role}: {m.content}" for m in prompt.messages)
        else:
            text = prompt.text or ""
        return [int.from_bytes(hashlib.blake2s(w.encode(), digest_size=2).digest(), "big")
                for w in text.split()]

    async def stream(self, tokens: list[int], params: DecodeParams) -> AsyncIterator[str]:
        seed = params.seed if params.seed is not None else 0
        rng = random.Random(hash((tuple(tokens), seed, params.temperature)))
        # Prefill is the sequence's own; the first token comes out of it. Later
        # tokens come one per shared decode step.
        await asyncio.sleep(self._prefill_s * len(tokens))
        for i in range(min(params.max_new_tokens, self._output_tokens)):
            if i:
                await self._clock.tick()
            word = _WORDS[rng.randrange(len(_WORDS))]
            yield word if i == 0 else " " + word

    async def close(self) -> None:
        await self._clock.close()

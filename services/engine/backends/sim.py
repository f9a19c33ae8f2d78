"""A simulated backend: no model, deterministic words at configured speeds.

It exists to measure the mesh's own overhead and to run many engines on one
machine. Its model is always named ``sim-*`` and its output is not language."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator

from llmesh.types import Prompt
from llmesh.engine.backends.base import DecodeParams

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
          "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa")


class SimBackend:
    name = "sim"

    def __init__(self, model: str, context_length: int, prefill_ms_per_token: float,
                 decode_ms_per_token: float, output_tokens: int):
        if not model.startswith("sim"):
            raise ValueError("a simulated model's name must start with 'sim'")
        self.model = model
        self.context_length = context_length
        self._prefill_s = prefill_ms_per_token / 1000.0
        self._decode_s = decode_ms_per_token / 1000.0
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
        if self._prefill_s:
            await asyncio.sleep(self._prefill_s * len(tokens))
        for i in range(min(params.max_new_tokens, self._output_tokens)):
            if self._decode_s:
                await asyncio.sleep(self._decode_s)
            word = _WORDS[rng.randrange(len(_WORDS))]
            yield word if i == 0 else " " + word

    async def close(self) -> None:
        return None

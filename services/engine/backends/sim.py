"""A simulated engine: no model, deterministic words, timed like a batching engine.

One scheduler loop runs steps the way vLLM's does: admit waiting sequences while the
batch has room and the KV cache has blocks for them (a block of their prefix already
held or cached costs none; cached blocks are evicted least recently used first), then
one step that prefills the newcomers' uncached prompt tokens and decodes one token for
every running sequence. Sequences wait (for batch
room or KV blocks) highest priority class first. A step lasts
``decode_ms_base + decode_ms_per_seq * batch + prefill_ms_per_token * uncached``.
With ``prefill_first`` (llmesh's llama.cpp engine) the newcomers' prefill runs first
as a step of its own and their first tokens go out after it; the running sequences'
decode follows, so their tokens come when they would have in the mixed step.
Prompt blocks are cached by chained hash, so a request that shares a prefix with an
earlier one skips that part of its prefill. The profile can be fitted to a real
engine (``llmesh bench engine --calibrate``). Models are named ``sim-*``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmesh.errors import InvalidArgument, NotFound
from llmesh.prompt_tokens import sim_token, sim_tokenize
from llmesh.types import Prompt, TokenLogprob
from llmesh.engine.backends.base import Capabilities, DecodeParams, Piece, Token
from llmesh.engine.kvblocks import BlockLedger, chain_hashes

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
          "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa")
VOCAB_SIZE = 1 << 16
_END = object()


@dataclass(frozen=True)
class SimProfile:
    prefill_ms_per_token: float = 0.0
    decode_ms_base: float = 5.0      # a decode step's fixed cost
    decode_ms_per_seq: float = 0.0   # added for each sequence in the step
    kv_blocks: int = 4096
    block_size: int = 16
    max_batch: int = 64
    output_tokens: int = 64          # answer length when max_tokens allows
    prefill_first: bool = False      # newcomers' prefill in a step of its own, first (llmesh's llama.cpp engine)
    piggyback: bool = False          # a GPU's step: prefill rides a decode step's time (see step_s)

    def step_s(self, batch: int, prefill_tokens: int) -> float:
        """Additive by default, as measured on llama.cpp on CPUs (docs/benchmarks.md). With
        ``piggyback``, a GPU's roofline: decoding is bound by reading the weights, prefill by
        compute, so a step lasts the longer of the two and a short prefill rides in a decode
        step nearly free (the premise of Sarathi-Serve's chunked prefill)."""
        decode = self.decode_ms_base + self.decode_ms_per_seq * batch if batch else 0.0
        prefill = self.prefill_ms_per_token * prefill_tokens
        return (max(decode, prefill) if self.piggyback else decode + prefill) / 1000.0

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> SimProfile:
        return cls(**json.loads(path.read_text()))


@dataclass(eq=False, slots=True)
class _Seq:
    tokens: list[int]        # prompt, then each generated token
    params: DecodeParams
    rng: random.Random
    limit: int               # tokens it produces: max_new_tokens, capped by the profile's answer length
    blocks: int = 0          # reserved for prompt + answer
    hashes: list[int] = field(default_factory=list)  # the prompt's block hashes, once (admission reads them each step)
    uncached: int = 0
    produced: int = 0
    cancelled: bool = False
    ready: list[Any] = field(default_factory=list)  # produced (pieces, then _END), not yet taken by its stream
    waiter: asyncio.Future[None] | None = None    # its stream, waiting for the next piece

    def put(self, piece: object) -> None:  # a Piece, or _END
        self.ready.append(piece)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


def _die_if_marked(prompt: Prompt, marker: str) -> None:
    """Fault injection: the process dies at once (SIGKILL, as a crash in native code
    would end it) on a prompt carrying the marker, before answering anything."""
    texts = [m.content for m in prompt.messages] if prompt.messages is not None else [prompt.text or ""]
    if any(marker in text for text in texts):
        os.kill(os.getpid(), signal.SIGKILL)


class SimBackend:
    name = "sim"
    vocab_size = VOCAB_SIZE
    # logprobs: words are drawn uniformly, each has probability 1/16
    capabilities = Capabilities(logprobs=True, continuation=True, steps=True)
    gpu_memory_share = 0.0

    def __init__(self, model: str, context_length: int, profile: SimProfile = SimProfile(),
                 die_on: str | None = None):
        if not model.startswith("sim"):
            raise ValueError("a simulated model's name must start with 'sim'")
        self.model = model
        self.models = (model,)
        self.context_length = context_length
        self.profile = profile
        self.kv_blocks = BlockLedger(profile.block_size, keep_released=True)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task[Any] | None = None
        self._gone = False  # a stream has ended since the last step
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._word_tokens = {w: sim_token(w) for w in _WORDS}
        self._die_on = die_on  # fault injection (tests): a prompt with this text kills the process

    def tokenize(self, prompt: Prompt) -> list[int]:
        if self._die_on is not None:
            _die_if_marked(prompt, self._die_on)
        return sim_tokenize(prompt)

    def tokenize_continuation(self, text: str) -> list[int]:
        return [sim_token(w) for w in text.split()]

    def kv_usage(self) -> float:
        """Blocks in use by running sequences (a shared one once, each one's partial last block)."""
        return (self.kv_blocks.held_blocks + len(self._running)) / self.profile.kv_blocks

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self.prefix_queries, self.prefix_hits

    async def stream(self, tokens: list[int], params: DecodeParams) -> AsyncGenerator[Piece, None]:
        async with contextlib.aclosing(self.stream_steps(tokens, params)) as steps:
            async for pieces in steps:
                for piece in pieces:
                    yield piece

    async def stream_steps(self, tokens: list[int], params: DecodeParams) -> AsyncGenerator[list[Piece], None]:
        """``stream``'s pieces, every piece ready at once in one list (a consumer
        that fell behind the steps takes the backlog in one go)."""
        if params.adapter is not None:
            raise NotFound(f"the sim backend serves no adapters; {params.adapter!r} is not loaded")
        if tokens and (min(tokens) < 0 or max(tokens) >= VOCAB_SIZE):
            raise InvalidArgument("the prompt holds token ids outside the vocabulary")
        seed = params.seed if params.seed is not None else 0
        rng = random.Random(hash((tuple(tokens), seed, params.temperature)))
        seq = _Seq(list(tokens), params, rng, min(params.max_new_tokens, self.profile.output_tokens))
        seq.blocks = math.ceil((len(tokens) + seq.limit) / self.profile.block_size)
        seq.hashes = chain_hashes(tokens, self.profile.block_size)
        if seq.blocks > self.profile.kv_blocks:
            raise InvalidArgument(f"the request needs {seq.blocks} KV blocks; the engine has {self.profile.kv_blocks}")
        self._enqueue(seq)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._run(), name="sim-steps")
        self._work.set()
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not seq.ready:
                    seq.waiter = loop.create_future()
                    await seq.waiter
                pieces, seq.ready = seq.ready, []
                if pieces[-1] is _END:  # nothing follows the end
                    if len(pieces) > 1:
                        yield pieces[:-1]
                    return
                yield pieces
        finally:
            seq.cancelled = True
            self._gone = True

    def _enqueue(self, seq: _Seq) -> None:
        """Behind every waiter of its priority class or a higher one, as the engine's queue orders them."""
        i = len(self._waiting)
        while i and self._waiting[i - 1].params.priority < seq.params.priority:
            i -= 1
        self._waiting.insert(i, seq)

    async def _run(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while self._waiting or self._running:
                await self._step()

    def _occupied(self) -> int:
        """KV blocks in use, as vLLM counts them: each distinct block held (a prefix two running
        sequences share, once), the cached ones, and what each running sequence has yet to fill
        of the blocks it reserved for its prompt and answer."""
        led = self.kv_blocks
        return led.held_blocks + led.cached_blocks + sum(s.blocks - led.owned(s) for s in self._running)

    def _admit(self) -> list[_Seq]:
        p, led, joined = self.profile, self.kv_blocks, []
        while self._waiting and len(self._running) < p.max_batch:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                continue
            present, cached_hits = led.present(seq.hashes)  # its prefix's blocks cost nothing new
            short = self._occupied() + seq.blocks - present - p.kv_blocks
            if short > 0:
                if led.cached_blocks - len(cached_hits) < short:
                    break  # waits for running sequences to finish
                led.evict(short, spare=cached_hits)
            self._waiting.popleft()
            hit = min(led.hold(seq, seq.tokens, seq.hashes), len(seq.tokens) - 1)
            self.prefix_queries += len(seq.tokens)
            self.prefix_hits += max(hit, 0)
            seq.uncached = len(seq.tokens) - max(hit, 0)
            self._running.append(seq)
            joined.append(seq)
        return joined

    async def _step(self) -> None:
        running = self._running
        if self._gone:  # a stream ended: drop its sequence if it had not finished
            self._gone = False
            for seq in [s for s in running if s.cancelled]:
                self._leave(seq)
        joined = self._admit() if self._waiting else ()
        if not running:
            if self._waiting:
                await asyncio.sleep(self.profile.decode_ms_base / 1000.0)
            return
        prefill = sum(s.uncached for s in joined) if joined else 0
        decoding = len(running) - len(joined)
        if self.profile.prefill_first and prefill and decoding:
            others = [s for s in running if s not in joined]
            await asyncio.sleep(self.profile.step_s(0, prefill))
            self._emit(list(joined))
            await asyncio.sleep(self.profile.step_s(decoding, 0))
            self._emit(others)
            return
        await asyncio.sleep(self.profile.step_s(decoding, prefill))
        self._emit(list(running))

    def _emit(self, seqs: list[_Seq]) -> None:
        """One token for each of ``seqs`` (a cancelled one leaves instead)."""
        block_size, word_tokens = self.profile.block_size, self._word_tokens
        for seq in seqs:
            if seq.cancelled:
                self._leave(seq)
                continue
            word = seq.rng.choice(_WORDS)  # the draw randrange(len(_WORDS)) makes, with less argument checking
            text = word if seq.produced == 0 and not seq.params.continues else " " + word
            piece: Piece = text
            if seq.params.logprobs is not None:
                lp = -math.log(len(_WORDS))
                top = tuple((w if text == word else " " + w, lp) for w in _WORDS[:seq.params.logprobs])
                piece = Token(text, TokenLogprob(text, lp, top))
            seq.put(piece)
            seq.produced += 1
            seq.tokens.append(word_tokens[word])  # the answer joins the sequence's KV, as in an engine
            if len(seq.tokens) % block_size == 0:  # it completed a block
                self.kv_blocks.grow(seq, seq.tokens)
            if seq.produced >= seq.limit:
                seq.put(_END)
                self._leave(seq)

    def _leave(self, seq: _Seq) -> None:
        self._running.remove(seq)
        self.kv_blocks.release(seq)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for seq in list(self._waiting) + self._running:
            seq.put(_END)

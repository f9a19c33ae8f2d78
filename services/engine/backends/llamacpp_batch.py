"""Continuous batching on llama.cpp's low-level API: one context, one decode thread.

Each running request owns a *slot*: a llama.cpp sequence id with room for a full
context in the KV cache. Every step the thread decodes the prompt chunks of newly
admitted sequences (up to ``n_batch`` tokens) and hands their first tokens out, then
decodes the next token of every sequence that was decoding, and samples each sequence
that produced logits with its own sampler chain. Requests join between steps and
leave as soon as they finish or are cancelled.

A slot keeps its tokens' KV after its request ends. A new request takes the free
slot whose cached tokens share the longest prefix with its prompt and prefills only
the rest. A longer prefix held by a *busy* slot is copied in with
``llama_memory_seq_cp`` (split KV: the donor's whole stream, then the tail dropped;
``unified_kv``: the cells are shared); a request whose prefix another sequence is
still prefilling waits for it, so a burst with one system prompt computes it once.

A request with a grammar (GBNF, for ``response_format``) gets a grammar sampler at
the head of its chain, so only tokens the grammar allows can be drawn. A request
asking for logprobs gets each token's log-softmax over the raw logits, with the
most likely alternatives.

The thread hands results to the event loop once per step (one wake-up per step,
not per token; two when a step has both prompt chunks and decoding sequences)."""

from __future__ import annotations

import codecs
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmesh.types import TokenLogprob
from llmesh.engine.backends.base import DecodeParams, Token
from llmesh.engine.backends.llamacpp_sampling import sampler_chain

log = logging.getLogger("llmesh.engine.llamacpp")

# Shorter shared prefixes are recomputed: copying a slot's cells costs about as much
# as prefilling a couple of dozen tokens (a whole stream is copied when KV is split).
SHARE_MIN = 32

Deliver = Callable[[list[tuple["Sequence", list[str | Token], BaseException | None, bool]]], None]


class DecodeFailed(RuntimeError):
    """llama.cpp could not decode a batch this sequence was part of."""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(eq=False)
class Sequence:
    """One request inside the runner. ``sink`` receives (pieces, error, done)."""
    prompt: list[int]
    params: DecodeParams
    sink: object
    grammar: str | None = None  # GBNF the answer must match, root rule "root"
    answered: list[int] = field(default_factory=list)  # the answer's start, produced elsewhere (a failover)
    cancelled: bool = False
    slot: _Slot | None = None
    pending: list[int] = field(default_factory=list)  # tokens to feed at the next steps
    produced: int = 0
    sampler: object = None
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    @property
    def held(self) -> _Slot:
        """The slot of an admitted sequence (every one the runner decodes has one)."""
        assert self.slot is not None
        return self.slot


@dataclass(eq=False)
class _Slot:
    seq_id: int
    tokens: list[int] = field(default_factory=list)  # exactly what this seq id holds in the KV cache
    busy: bool = False
    last_used: float = 0.0


class BatchRunner:
    """Owns the llama.cpp context; all llama calls happen on its thread."""

    def __init__(self, model_p, vocab_p, *, n_slots: int, n_ctx_per_seq: int, n_threads: int, n_batch: int,
                 deliver: Deliver, unified_kv: bool = False,
                 on_blocks: Callable[[int, list[int], bool], None] = lambda seq_id, tokens, reset: None):
        import llama_cpp as lc

        self._lc = lc
        self._vocab = vocab_p
        self._deliver = deliver
        self._on_blocks = on_blocks
        self.n_slots = n_slots
        self.n_ctx_per_seq = n_ctx_per_seq
        self.n_batch = n_batch
        params = lc.llama_context_default_params()
        # Every slot can hold a full context. Split (the default), each sequence has
        # its own cells and attends over them only; unified, all share one pool, so a
        # busy sequence's prefix can be shared, but every token attends over all cells.
        params.n_ctx = n_slots * n_ctx_per_seq
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_slots
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.kv_unified = unified_kv
        self.unified_kv = unified_kv
        params.no_perf = True
        self._ctx = lc.llama_init_from_model(model_p, params)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        self._slots = [_Slot(i) for i in range(n_slots)]
        self._incoming: list[Sequence] = []
        self._active: list[Sequence] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._piece = ctypes.create_string_buffer(256)
        self._n_vocab = lc.llama_vocab_n_tokens(vocab_p)
        # Counters for tests and metrics: decode calls, prompt tokens looked up in
        # the cache and found there.
        self.steps = 0
        self.prefix_copies = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._thread = threading.Thread(target=self._run, name="llamacpp-batch", daemon=True)
        self._thread.start()

    # -- called from the event loop -------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the llama.cpp runner is stopped")
            self._incoming.append(seq)
            self._cond.notify()

    def cancel(self, seq: Sequence) -> None:
        with self._cond:
            seq.cancelled = True
            self._cond.notify()

    def cells_in_use(self) -> int:
        return sum(len(s.tokens) for s in self._slots if s.busy)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        self._lc.llama_batch_free(self._batch)
        self._lc.llama_free(self._ctx)

    # -- the decode thread ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._incoming and not self._active:
                    self._cond.wait()
                if self._stopping:
                    out: list[tuple[Sequence, list[str | Token], BaseException | None, bool]] = []
                    for seq in self._incoming + self._active:
                        self._finish(seq, out, RuntimeError("the engine is stopping"))
                    self._incoming = []
                    break
                self._admit()
            out = []
            try:
                self._step(out)
            except Exception as exc:  # a bug here must not end the engine
                log.exception("llama.cpp step failed; failing its sequences")
                for seq in list(self._active):
                    self._lc.llama_memory_seq_rm(self._mem, seq.held.seq_id, -1, -1)
                    seq.held.tokens = []
                    self._on_blocks(seq.held.seq_id, [], True)
                    self._finish(seq, out, DecodeFailed(str(exc)))
            if out:
                self._deliver(out)
        if out:
            self._deliver(out)

    def _admit(self) -> None:
        """Moves waiting sequences into free slots, reusing the longest cached prefix;
        higher priority classes first (the engine's admission already orders them, but
        a sequence outside it, such as a self-test, may make them wait here)."""
        still = []
        for seq in sorted(self._incoming, key=lambda s: -s.params.priority):
            if seq.cancelled:
                self._deliver([(seq, [], None, True)])
                continue
            free = [s for s in self._slots if not s.busy]
            if not free or self._prefix_coming(seq):
                still.append(seq)
                continue
            try:
                self._place(seq, free)
            except ValueError as exc:
                self._deliver([(seq, [], exc, True)])
                self._release(seq)
                continue
            self._active.append(seq)
        self._incoming = still

    def _prefix_coming(self, seq: Sequence) -> bool:
        """A running sequence is still prefilling a long prefix this one shares (a burst
        of requests with one system prompt): wait for it, then copy its cells."""
        head = seq.prompt[:SHARE_MIN]
        for other in self._active:
            if other.prompt[:SHARE_MIN] != head:
                continue
            share = min(common_prefix(other.prompt, seq.prompt), len(seq.prompt) - 1)
            if share >= SHARE_MIN and len(other.held.tokens) < share:
                return True
        return False

    def _place(self, seq: Sequence, free: list[_Slot]) -> None:
        lc, prompt = self._lc, seq.prompt
        limit = len(prompt) - 1  # the last prompt token is always fed: its logits start decoding
        reuse = {s.seq_id: min(common_prefix(s.tokens, prompt), limit) for s in self._slots}
        slot = max(free, key=lambda s: (reuse[s.seq_id], -s.last_used if reuse[s.seq_id] == 0 else 0))
        keep = reuse[slot.seq_id]
        donor = max(self._slots, key=lambda s: reuse[s.seq_id])
        if donor is not slot and reuse[donor.seq_id] - keep >= (1 if self.unified_kv else SHARE_MIN):
            # A busy slot holds more of this prompt: share (unified) or copy (split) its cells.
            keep = reuse[donor.seq_id]
            if self.unified_kv:
                lc.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
                lc.llama_memory_seq_cp(self._mem, donor.seq_id, slot.seq_id, 0, keep)
            else:  # only whole streams copy across; the copy runs before the next decode
                lc.llama_memory_seq_cp(self._mem, donor.seq_id, slot.seq_id, -1, -1)
                lc.llama_memory_seq_rm(self._mem, slot.seq_id, keep, -1)
            self.prefix_copies += 1
        elif not lc.llama_memory_seq_rm(self._mem, slot.seq_id, keep, -1):
            lc.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
            keep = 0
        slot.tokens = prompt[:keep]
        slot.busy = True
        self._on_blocks(slot.seq_id, slot.tokens, True)
        seq.slot = slot
        self.prefix_queries += len(prompt)
        self.prefix_hits += keep
        seq.pending = prompt[keep:]
        seq.sampler = sampler_chain(lc, self._vocab, self._n_vocab, seq.params, seq.grammar, prompt, seq.answered)

    def _step(self, out: list) -> None:
        """Prompt chunks first, in a decode call of their own, their first tokens handed out at once;
        then one token for each sequence that was decoding. On a CPU a batch costs the sum of its
        parts (docs/benchmarks.md), so a newcomer's first token does not wait for its neighbours'
        tokens, and theirs come when they would have in one batch with the prompts."""
        for seq in [s for s in self._active if s.cancelled]:
            self._finish(seq, out, None)
        prompts = [s for s in self._active if len(s.pending) > 1]
        decoding = [s for s in self._active if len(s.pending) == 1]
        if prompts:
            plan: list[tuple[Sequence, int]] = []
            room = self.n_batch
            for seq in prompts:
                if room <= 0:
                    break
                take = min(len(seq.pending), room)
                plan.append((seq, take))
                room -= take
            self._decode(plan, out, isolate=len(plan) > 1)
            if decoding and out:
                self._deliver(out[:])
                out.clear()
        if decoding:
            self._decode([(s, 1) for s in decoding], out, isolate=len(decoding) > 1)

    def _decode(self, plan: list[tuple[Sequence, int]], out: list, isolate: bool) -> None:
        """One ``llama_decode`` over ``plan``; then each sequence whose prompt is in
        samples its next token. A failed batch is rolled back and, when it held several
        sequences, retried one sequence at a time so only the culprit fails."""
        lc, batch = self._lc, self._batch
        n = 0
        logits_at: list[tuple[Sequence, int]] = []
        for seq, take in plan:
            slot = seq.held
            pos = len(slot.tokens)
            for i in range(take):
                batch.token[n] = seq.pending[i]
                batch.pos[n] = pos + i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = slot.seq_id
                batch.logits[n] = 0
                n += 1
            if take == len(seq.pending):
                batch.logits[n - 1] = 1
                logits_at.append((seq, n - 1))
        batch.n_tokens = n
        rc = lc.llama_decode(self._ctx, batch)
        self.steps += 1
        if rc != 0:
            for seq, _ in plan:  # nothing of this batch counts: back to where each sequence was
                lc.llama_memory_seq_rm(self._mem, seq.held.seq_id, len(seq.held.tokens), -1)
            if isolate:
                for item in plan:
                    self._decode([item], out, isolate=False)
                return
            seq = plan[0][0]
            log.error("llama_decode failed", extra={"rc": rc, "tokens": n})
            self._finish(seq, out, DecodeFailed(f"llama_decode returned {rc}"))
            return
        for seq, take in plan:
            seq.held.tokens.extend(seq.pending[:take])
            del seq.pending[:take]
            self._on_blocks(seq.held.seq_id, seq.held.tokens, False)
        for seq, idx in logits_at:
            tok = lc.llama_sampler_sample(seq.sampler, self._ctx, idx)
            if lc.llama_vocab_is_eog(self._vocab, tok):
                self._finish(seq, out, None)
                continue
            seq.produced += 1
            seq.pending.append(tok)
            done = seq.produced >= seq.params.max_new_tokens
            text = self._text(seq, tok)
            piece: str | Token = text
            if seq.params.logprobs is not None:
                piece = Token(text, self._logprob(idx, tok, seq.params.logprobs))
            out.append((seq, [piece], None, done))
            if done:
                self._release(seq)

    def _logprob(self, idx: int, tok: int, top: int) -> TokenLogprob:
        """Log-softmax of the raw logits at ``idx``: the chosen token's and the ``top`` best."""
        import numpy as np

        logits = np.ctypeslib.as_array(self._lc.llama_get_logits_ith(self._ctx, idx), shape=(self._n_vocab,))
        peak = float(logits.max())
        lse = peak + float(np.log(np.exp(logits - peak).sum()))
        best: tuple[tuple[str, float], ...] = ()
        if top:
            ids = np.argpartition(logits, -top)[-top:]
            ids = ids[np.argsort(-logits[ids])]
            best = tuple((self._token_text(int(i)), float(logits[i]) - lse) for i in ids)
        return TokenLogprob(self._token_text(tok), float(logits[tok]) - lse, best)

    def _token_text(self, tok: int) -> str:
        n = self._lc.llama_token_to_piece(self._vocab, tok, self._piece, len(self._piece), 0, False)
        return self._piece.raw[:max(n, 0)].decode("utf-8", "replace")

    def _text(self, seq: Sequence, tok: int) -> str:
        n = self._lc.llama_token_to_piece(self._vocab, tok, self._piece, len(self._piece), 0, False)
        return seq.decoder.decode(self._piece.raw[:max(n, 0)])

    def _finish(self, seq: Sequence, out: list, error: BaseException | None) -> None:
        out.append((seq, [], error, True))
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq in self._active:
            self._active.remove(seq)
        if seq.sampler is not None:
            self._lc.llama_sampler_free(seq.sampler)
            seq.sampler = None
        slot = seq.slot
        if slot is not None:
            slot.busy = False
            slot.last_used = time.monotonic()
            seq.pending = []  # a sampled token not fed back never entered the cache

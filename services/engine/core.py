"""The engine core: checks a request against the model, waits for a slot, and turns
the backend's token stream into final text deltas, a finish reason and usage."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import cast

from llmesh.errors import (ContextLengthExceeded, InputTooLong, InvalidArgument, ModelNotFound, NotEmbedding,
                           NotGenerative)
from llmesh.tool_prompt import offered
from llmesh.types import Delta, Finish, FinishReason, Priority, Prompt, Sampling, TokenLogprob, Tools, Usage
from llmesh.validation import check_request, uses_tools
from llmesh.engine.admission import Admission
from llmesh.engine.backends.base import (Backend, CallReading, DecodeParams, EmbeddingBackend, Piece, Token,
                                         calls_tools, can_continue, can_embed, steps_of)
from llmesh.engine.metrics import EngineMetrics
from llmesh.engine.stops import StopMatcher


class _Timing:
    """One request's timestamps, turned into vLLM's per-request metrics at the end."""

    __slots__ = ("arrived", "started", "first", "last", "gaps")

    def __init__(self, arrived: float, started: float):
        self.arrived, self.started = arrived, started
        self.first: float | None = None
        self.last = 0.0  # set with first
        self.gaps: list[float] = []

    def sent(self, tokens: int) -> None:
        """A Delta with ``tokens`` tokens goes out now: one observation a step (as vLLM's),
        its tokens sharing the gap since the previous one."""
        now = time.monotonic()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append((now - self.last) / tokens)
        self.last = now

    def record(self, m: EngineMetrics, finish: Finish) -> None:
        usage = finish.usage
        m.queue_time.observe(self.started - self.arrived)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        m.request_prompt_tokens.observe(usage.prompt_tokens)
        m.request_generation_tokens.observe(usage.completion_tokens)
        m.success(finish.reason.value)
        end = time.monotonic()
        m.e2e.observe(end - self.arrived)
        if self.first is not None:
            m.ttft.observe(self.first - self.arrived)
            if usage.completion_tokens > 1:
                m.tpot.observe((self.last - self.first) / (usage.completion_tokens - 1))
        itl = m.itl
        for gap in self.gaps:
            itl.observe(gap)


@dataclass(frozen=True, slots=True)
class LastDelta(Delta):
    """The answer's last Delta: only the Finish follows, with nothing awaited in between,
    so a consumer may send the two together (one message fewer an answer)."""


MAX_EMBED_TOKENS = 300_000  # an embeddings request's inputs together, as OpenAI's API limits them


@dataclass(frozen=True, slots=True)
class Embedded:
    """Embed's answer: one vector per input, in order, and the inputs' tokens."""
    vectors: list[list[float]]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Defaults:
    temperature: float = 1.0
    top_p: float = 1.0


class EngineCore:
    def __init__(self, backend: Backend, admission: Admission, defaults: Defaults = Defaults(),
                 metrics: EngineMetrics | None = None):
        self.backend = backend
        self.admission = admission
        self.defaults = defaults
        self.metrics = metrics
        self._active: dict[int, int] = {}  # id(backend) -> requests using it
        self._by_name: dict[str, int] = {}  # model or adapter name -> requests naming it, running or queued

    def active(self, backend: Backend) -> int:
        return self._active.get(id(backend), 0)

    def in_flight(self, name: str) -> int:
        """Requests naming this model or LoRA adapter, running or queued here now."""
        return self._by_name.get(name, 0)

    def count_tokens(self, model: str, prompt: Prompt) -> int:
        backend = self.backend
        self._check_model(backend, model)
        return len(backend.tokenize(prompt))

    async def generate(self, model: str, prompt: Prompt, sampling: Sampling, priority: Priority = Priority.NORMAL,
                       continuation: str = "", tools: Tools | None = None) -> AsyncGenerator[Delta | Finish, None]:
        """Yields Delta items, then exactly one Finish. Raises before the first
        item for a bad request, a full queue, or when shed for a higher priority.
        With tools offered, calls come out as Deltas' ``tool_calls`` (``CallReader``)."""
        backend = self.backend  # one request, one backend, even if a model load swaps it meanwhile
        tokens, params = self._prepare(backend, model, prompt, sampling, priority, continuation, tools)
        # with tools, the backend's reader applies the stop strings, to text only (never inside a call)
        reader = backend.call_reader(params.tools, sampling.stop) \
            if params.tools is not None and calls_tools(backend) else None
        arrived = time.monotonic()
        self._enter(backend, model)
        try:
            async with self.admission.slot(priority):
                timing = _Timing(arrived, time.monotonic())
                # Decoding is inline (no generator of its own): one generator a message fewer.
                matcher = StopMatcher(sampling.stop if reader is None else ())
                plain = not matcher.active and params.logprobs is None and reader is None  # str pieces, final
                produced = 0
                steps = steps_of(backend, tokens, params)
                try:
                    async for pieces in steps:  # every piece ready now becomes one Delta
                        if plain:
                            produced += len(pieces)
                            count = len(pieces) - pieces.count("")  # "": a character not complete yet
                            ends = produced >= params.max_new_tokens
                            if count:
                                texts = cast("list[str]", pieces)  # no Token pieces without logprobs
                                text = texts[0] if len(texts) == 1 else "".join(texts)
                                delta = LastDelta(text, count) if ends else Delta(text, count)
                        else:
                            found, taken = self._delta(pieces, matcher)
                            if found is not None and reader is not None:
                                found = reader.feed(found)
                            produced += taken
                            count = found is not None
                            # with stop strings, a length end may still flush held-back text
                            ends = matcher.stopped or (produced >= params.max_new_tokens and not matcher.active)
                            if found is not None:
                                delta = LastDelta(found.text, found.tokens, found.logprobs, found.tool_calls) \
                                    if ends else found
                        if count:
                            timing.sent(delta.tokens)
                            yield delta
                        if matcher.stopped or (reader and reader.stopped) or produced >= params.max_new_tokens:
                            break  # the backend has nothing more for this answer
                finally:
                    await steps.aclose()
                if (rest := self._rest(matcher, reader)) is not None:
                    yield rest
                stopped = matcher.stopped or (reader is not None and reader.stopped)
                reason = FinishReason.LENGTH if produced >= params.max_new_tokens and not stopped else FinishReason.STOP
                finish = Finish(reader.reason(reason) if reader is not None else reason,
                                Usage(prompt_tokens=len(tokens), completion_tokens=produced))
                if self.metrics is not None:
                    timing.record(self.metrics, finish)
                yield finish
        finally:
            self._leave(backend, model)

    async def embed(self, model: str, texts: list[str], dimensions: int | None = None,
                    priority: Priority = Priority.NORMAL) -> Embedded:
        """The embeddings of ``texts`` (bounded by the proto's rules) on a backend that serves
        them: tokenized in a thread and embedded (``run_embed``) in an admission slot like any
        request. An input over the model's limit is refused, never truncated."""
        backend = self.backend
        self._check_model(backend, model)
        if not can_embed(backend):
            raise NotEmbedding(model)
        if dimensions is not None:
            raise InvalidArgument(f"The model '{model}' does not support 'dimensions': its vectors have a fixed "
                                  "size.", param="dimensions")
        arrived = time.monotonic()
        self._enter(backend, model)
        try:
            ids = await asyncio.to_thread(backend.tokenize_inputs, texts)
            limit = backend.max_input_tokens
            for i, one in enumerate(ids):
                if len(one) > limit:
                    raise InputTooLong(i, len(one), limit)
            tokens = sum(len(one) for one in ids)
            if tokens > MAX_EMBED_TOKENS:
                raise InvalidArgument(f"The inputs have {tokens} tokens together; at most {MAX_EMBED_TOKENS} per "
                                      "request: split them over several.", param="input")
            async with self.admission.slot(priority):
                vectors = await run_embed(backend, ids)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(tokens)
                self.metrics.request_prompt_tokens.observe(tokens)
                self.metrics.success("stop")
                self.metrics.e2e.observe(time.monotonic() - arrived)
            return Embedded(vectors, tokens)
        finally:
            self._leave(backend, model)

    def _prepare(self, backend: Backend, model: str, prompt: Prompt, sampling: Sampling, priority: Priority,
                 continuation: str, tools: Tools | None = None) -> tuple[list[int], DecodeParams]:
        """The request checked against the backend and tokenized (tools and tool messages
        rendered, a continued answer's text appended): its tokens and what the backend decodes them with."""
        self._check_model(backend, model)
        if not backend.capabilities.generates:
            raise NotGenerative(model)
        self._check_tools(backend, prompt, sampling, tools)
        check_request(model, prompt, sampling, tools=tools, tools_allowed=True)
        self._check_capabilities(backend, sampling)
        tokens = backend.tokenize_chat(prompt, tools) if calls_tools(backend) and prompt.is_chat \
            else backend.tokenize(prompt)
        if not tokens:
            raise InvalidArgument("The prompt is empty.", param="messages" if prompt.is_chat else "prompt")
        answered: list[int] = []
        if continuation:
            if not can_continue(backend) or offered(tools) is not None:
                raise InvalidArgument(f"The {backend.name} backend cannot continue an answer"
                                      f"{' that may call tools' if tools else ''}.", param="continuation")
            answered = backend.tokenize_continuation(continuation)
            tokens = tokens + answered
        params = self._decode_params(backend, len(tokens), sampling, model, priority, len(answered))
        shown = offered(tools)
        return tokens, params if shown is None else replace(params, tools=shown)

    def _enter(self, backend: Backend, model: str) -> None:
        key = id(backend)
        self._active[key] = self._active.get(key, 0) + 1
        self._by_name[model] = self._by_name.get(model, 0) + 1

    def _leave(self, backend: Backend, model: str) -> None:
        key = id(backend)
        self._active[key] -= 1
        if not self._active[key]:
            del self._active[key]
        self._by_name[model] -= 1
        if not self._by_name[model]:
            del self._by_name[model]

    @staticmethod
    def _rest(matcher: StopMatcher, reader: CallReading | None) -> Delta | None:
        """Text held back for a stop string that did not come, at the answer's end."""
        if reader is not None:
            return reader.flush()
        rest = matcher.flush()
        return Delta(text=rest, tokens=0) if rest else None

    @staticmethod
    def _delta(pieces: list[Piece], matcher: StopMatcher) -> tuple[Delta | None, int]:
        """One step's pieces through the stop strings, with their logprobs: the Delta (None
        when nothing became final) and the pieces taken, up to a stop string (``matcher.stopped``)."""
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        count = taken = 0
        for piece in pieces:
            taken += 1
            if isinstance(piece, Token):
                text = matcher.feed(piece.text)
                logprobs.append(piece.logprob)
                count += 1
            else:
                text = matcher.feed(piece)
                if text or matcher.stopped:
                    count += 1
            if text:
                texts.append(text)
            if matcher.stopped:
                break
        if not count:
            return None, taken
        return Delta(text=texts[0] if len(texts) == 1 else "".join(texts), tokens=count,
                     logprobs=tuple(logprobs)), taken

    async def self_test(self, backend: Backend | None = None) -> tuple[bool, str, float]:
        """One greedy token from a tiny prompt, straight through the backend (no
        admission, no metrics): (ok, why not, milliseconds). Run only when idle, or
        on a freshly loaded backend before it takes traffic (warmup)."""
        backend = backend or self.backend
        started = time.monotonic()
        try:
            if can_embed(backend) and not backend.capabilities.generates:  # an embedder's test: one vector
                vectors = await run_embed(backend, backend.tokenize_inputs(["ping"]))
                ok = len(vectors) == 1 and len(vectors[0]) > 0
                return ok, "" if ok else "the backend produced no vector", (time.monotonic() - started) * 1000
            tokens = backend.tokenize(Prompt(text="ping"))
            pieces = backend.stream(tokens, DecodeParams(max_new_tokens=1, temperature=0.0, top_p=1.0, seed=0))
            async with aclosing(pieces):
                produced = [piece async for piece in pieces]
        except Exception as exc:  # noqa: BLE001 - any failure is the answer
            return False, f"{type(exc).__name__}: {exc}", (time.monotonic() - started) * 1000
        ms = (time.monotonic() - started) * 1000
        if not produced:
            return False, "the backend produced no token", ms
        return True, "", ms

    def kv_usage(self) -> float:
        return self.backend.kv_usage()

    @staticmethod
    def _check_model(backend: Backend, model: str) -> None:
        if model not in backend.models:
            raise ModelNotFound(model)

    @staticmethod
    def _check_tools(backend: Backend, prompt: Prompt, sampling: Sampling, tools: Tools | None) -> None:
        """Tools only on a backend that calls them, in a chat, not with response_format nor
        continuing an answer (a call's text cannot be resumed elsewhere)."""
        needs = uses_tools(prompt, tools)
        if needs is None and tools is None:
            return
        if needs is not None and not backend.capabilities.tools:
            raise InvalidArgument(f"The {backend.name} backend cannot call tools.", param=needs)
        if not prompt.is_chat:
            raise InvalidArgument("Tools need a chat (messages), not a prompt.", param="tools")
        if offered(tools) is not None and sampling.response_format is not None:
            raise InvalidArgument("response_format cannot be combined with tools an llmesh engine may call; "
                                  "use tool_choice 'none' or leave response_format out.", param="response_format")

    @staticmethod
    def _check_capabilities(backend: Backend, sampling: Sampling) -> None:
        """A request that needs what the backend cannot do is refused, never served without it."""
        can = backend.capabilities
        if sampling.logprobs is not None and not can.logprobs:
            raise InvalidArgument(f"The {backend.name} backend cannot report logprobs.", param="logprobs")
        if sampling.response_format is not None and not can.response_format:
            raise InvalidArgument(f"The {backend.name} backend cannot enforce response_format.",
                                  param="response_format")
        for knob in sampling.knobs():
            if knob not in can.knobs:
                raise InvalidArgument(f"The {backend.name} backend does not support {knob}.", param=knob)

    def _decode_params(self, backend: Backend, prompt_tokens: int, sampling: Sampling, adapter: str,
                       priority: Priority, continued_tokens: int = 0) -> DecodeParams:
        ctx = backend.context_length
        room = ctx - prompt_tokens
        if room <= 0:
            raise ContextLengthExceeded(prompt_tokens, prompt_tokens, ctx)
        if sampling.max_tokens is not None and sampling.max_tokens > room:
            raise ContextLengthExceeded(prompt_tokens, prompt_tokens + sampling.max_tokens, ctx)
        temperature = self.defaults.temperature if sampling.temperature is None else sampling.temperature
        top_p = self.defaults.top_p if sampling.top_p is None else sampling.top_p
        knobs = sampling.knobs()  # off values as the defaults; a top_k past the vocabulary is all of it
        return DecodeParams(max_new_tokens=sampling.max_tokens or room, temperature=temperature,
                            top_p=top_p, seed=sampling.seed, adapter=adapter if adapter != backend.model else None,
                            priority=priority, logprobs=sampling.logprobs,
                            response_format=sampling.response_format, continued_tokens=continued_tokens,
                            top_k=min(int(knobs.get("top_k", 0)), backend.vocab_size),
                            min_p=knobs.get("min_p", 0.0),
                            repetition_penalty=knobs.get("repetition_penalty", 1.0),
                            presence_penalty=knobs.get("presence_penalty", 0.0),
                            frequency_penalty=knobs.get("frequency_penalty", 0.0))


async def run_embed(backend: EmbeddingBackend, ids: list[list[int]]) -> list[list[float]]:
    """``backend.embed(ids)``: awaited where it is a coroutine function (vLLM's engine embeds
    asynchronously; cancelling it aborts its requests), else run in a thread (numpy releases
    the GIL), which cannot be stopped: a cancelled caller waits for it, so its slot stays taken
    until it ends."""
    if inspect.iscoroutinefunction(backend.embed):
        return await cast(Awaitable[list[list[float]]], backend.embed(ids))
    work = asyncio.ensure_future(asyncio.to_thread(backend.embed, ids))
    try:
        return cast(list[list[float]], await asyncio.shield(work))
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise

"""One request's way through the gateway, shared by the HTTP and gRPC fronts.

The concerns a platform adds (authentication, validation, grants, routing,
limits, guards, audit) are stages run in order before the call, like Envoy's
filter chain: a stage sees the request's ``Context``, may refuse it (raise),
rewrite it (``ctx.req = ...``), annotate the record or add an output filter, and
is told the outcome in ``finish``. The pipeline itself only orchestrates: stages,
cache lookup, endpoint pick, the engine stream (retrying elsewhere before the
first token), output filters, cache store, access log.

It talks to the other services through the small ports below, so it has no
gRPC in it and tests can drive it with real or in-process adapters."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from opentelemetry.trace import INVALID_SPAN, NoOpTracer, Span, SpanKind, Status, StatusCode, Tracer

from llmesh.background import Background
from llmesh.errors import (DeadlineExceeded, Internal, InvalidArgument, LlmeshError, ModelNotFound, Overloaded,
                           QueueFull, Unavailable)
from llmesh.liveconfig.schema import MeshConfig, ModelPolicy, Provider
from llmesh.telemetry import bind_trace_id, extract
from llmesh.types import Delta, Finish, FinishReason, Priority, Prompt, Sampling, Tools, Usage
from llmesh.validation import check_request, uses_tools
from llmesh.gateway.logprob_gate import LogprobGate
from llmesh.gateway.picking import EndpointPicker, PickInput
from llmesh.gateway.picking.types import work_tokens
from llmesh.gateway.record import RequestRecord
from llmesh.gateway.policy import apply_policy, route
from llmesh.gateway.resilience import Breakers, RetryBudgetGate

log = logging.getLogger("llmesh.gateway.access")
CACHE_HEADER = "x-llmesh-cache"

@dataclass(slots=True)
class _Attempts:
    """One request's upstream attempts so far."""
    count: int = 0
    last_error: LlmeshError | None = None
    done: bool = False
    next_model: bool = False
    can_continue: bool = False  # this upstream can pick up an answer another one started
    mid_stream: LlmeshError | None = None  # the upstream died after tokens were sent
    carried_tokens: int = 0  # tokens sent so far
    carried_before_leg: int = 0  # tokens sent before the last failover
    busy: bool = False  # an upstream refused it for a full queue


FALLBACK_HEADER = "x-llmesh-fallback"  # the model that answered, when it was a fallback
FAILOVER_HEADER = "x-llmesh-failover"  # how many times the answer moved to another engine mid-stream
ENDPOINT_FAILURES = (Unavailable, Internal)  # what counts against a breaker as a failure


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, as authentication found it."""
    tenant: str = "default"
    subject: str = "local"        # key id, JWT subject, or "local" in local mode
    method: str = "local"         # api_key | jwt | local
    groups: tuple[str, ...] = ()
    models: tuple[str, ...] | None = None  # a key's own model list, narrower than the tenant's


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    request_id: str
    tenant: str
    model: str
    prompt: Prompt
    sampling: Sampling
    timeout_s: float
    user: str | None = None  # keeps a user on one arm of a traffic split
    trace_headers: Mapping[str, str] | None = None  # W3C trace context from HTTP clients
    operation: str = "chat"  # gen_ai.operation.name: chat | text_completion
    credential: str | None = None  # the bearer token or API key the client sent
    caller: Caller = Caller()
    priority: Priority = Priority.NORMAL
    continuation: str = ""  # answer text already sent, when a stream fails over to another engine
    tools: Tools | None = None  # functions the model may call (OpenAI-compatible providers only)
    checked: bool = False  # the front already checked it against the protos' rules (gRPC: as it arrived)
    stream: bool = True  # False: the client takes the answer at once (upstreams may send it whole)


class OutputFilter(Protocol):
    """Rewrites the answer's text as it streams (PII masking, restoring)."""
    def feed(self, text: str) -> str: ...
    def flush(self) -> str: ...


@dataclass(slots=True)
class Context:
    """One request as the stages see it. ``record`` is the access-log record;
    ``headers`` reach the client (HTTP headers, gRPC trailing metadata)."""
    req: CompletionRequest
    record: RequestRecord
    span: Span
    policy: ModelPolicy = ModelPolicy()
    headers: dict[str, str] = field(default_factory=dict)
    filters: list[OutputFilter] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)  # a stage's own per-request state
    asked: str = ""  # the model name the client asked for (an alias, before any stage rewrote it)
    answer: list[str] | None = None  # a stage sets a list: the answer's text (before output filters) lands in it
    upstream: Upstream | None = None  # a stage's way of getting the answer (cascade): wraps the plain call

    @classmethod
    def of(cls, req: CompletionRequest) -> Context:
        """A blank context to hand to ``Pipeline.run``, which fills it in."""
        return cls(req, RequestRecord(req.model, req.tenant), INVALID_SPAN)


Call = Callable[["CompletionRequest"], AsyncIterator[Delta | Finish]]
Upstream = Callable[["CompletionRequest", Call], AsyncIterator[Delta | Finish]]
"""Given the request and the pipeline's call (endpoints, retries, fallbacks of the
request's model, within the request's deadline), yields the answer."""


class Stage(Protocol):
    async def admit(self, ctx: Context) -> None:
        """Refuse (raise a LlmeshError), rewrite or annotate the request."""
    async def finish(self, ctx: Context) -> None:
        """The outcome is in ctx.record; called for every stage whose admit ran,
        also when it refused, last stage first."""


class ValidateStage:
    async def admit(self, ctx: Context) -> None:
        req = ctx.req
        check_request(req.model, req.prompt, req.sampling, user=req.user, tools=req.tools, tools_allowed=True,
                      rules_checked=req.checked)

    async def finish(self, ctx: Context) -> None:
        pass


class RouteStage:
    """Alias -> model (weighted, sticky per user), the model's policy and defaults."""

    def __init__(self, catalog: Catalog, config: Callable[[], MeshConfig]):
        self._catalog = catalog
        self._config = config

    async def admit(self, ctx: Context) -> None:
        req = ctx.req
        config = self._config()
        target, policy = route(req.model, config, req.user or req.request_id)
        if not self._catalog.known(target) and config.provider_for(target) is None:
            raise ModelNotFound(req.model)
        prompt, sampling = apply_policy(req.prompt, req.sampling, policy)
        if target != req.model or prompt is not req.prompt or sampling is not req.sampling:
            ctx.req = replace(req, model=target, prompt=prompt, sampling=sampling)
        ctx.policy = policy
        ctx.record.model = target

    async def finish(self, ctx: Context) -> None:
        pass


class EngineClient(Protocol):
    def generate(self, address: str, req: CompletionRequest, timeout_s: float, parent: Span
                 ) -> AsyncIterator[Delta | Finish]: ...


class ProviderPort(Protocol):
    """External OpenAI-compatible APIs (the live config's ``providers``)."""
    def generate(self, provider: Provider, remote_model: str, req: CompletionRequest, timeout_s: float
                 ) -> AsyncIterator[Delta | Finish]: ...


class ResponseCache(Protocol):
    def applies(self, req: CompletionRequest) -> bool: ...
    async def lookup(self, req: CompletionRequest, parent: Span) -> tuple[str, Finish] | None: ...
    async def store(self, req: CompletionRequest, text: str, finish: Finish, parent: Span) -> None: ...


class Catalog(Protocol):
    def known(self, model: str) -> bool: ...


class Pipeline:
    def __init__(self, picker: EndpointPicker, engines: EngineClient, catalog: Catalog,
                 cache: ResponseCache | None = None,
                 config: Callable[[], MeshConfig] = MeshConfig,
                 observe: Callable[[RequestRecord], None] = lambda record: None,
                 tracer: Tracer | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 stages: Sequence[Stage] | None = None,
                 prompt_tokens: Callable[[str, Prompt], Sequence[int]] = lambda model, prompt: (),
                 breakers: Breakers | None = None,
                 budget: RetryBudgetGate | None = None,
                 providers: ProviderPort | None = None,
                 retry_after_s: float = 1.0):
        self._picker = picker
        self._prompt_tokens = prompt_tokens
        self._engines = engines
        self._cache = cache
        self._stages = list(stages) if stages is not None else [ValidateStage(), RouteStage(catalog, config)]
        self._observe = observe
        self._tracer = tracer or NoOpTracer()
        self._clock = clock
        self._background = Background()
        self._breakers = breakers
        self._budget = budget
        self._providers = providers
        self._config = config
        self._retry_after_s = retry_after_s  # the hint a client gets when every queue is full

    async def run(self, req: CompletionRequest, ctx: Context | None = None) -> AsyncIterator[Delta | Finish]:
        """Yields text deltas then one Finish; raises a LlmeshError on failure.
        Pass a ``ctx`` to read what the stages said (headers) once the first item came."""
        started = self._clock()
        record = RequestRecord(model=req.model, tenant=req.tenant)
        span = self._tracer.start_span(f"{req.operation} {req.model}", context=extract(req.trace_headers),
                                       kind=SpanKind.SERVER if req.trace_headers is not None else SpanKind.INTERNAL,
                                       attributes=request_attributes(req))
        bind_trace_id(span)
        if ctx is None:
            ctx = Context(req, record, span)
        else:
            ctx.req, ctx.record, ctx.span = req, record, span
        ctx.asked = req.model
        entered: list[Stage] = []
        try:
            for stage in self._stages:
                entered.append(stage)
                await stage.admit(ctx)
            req = ctx.req
            cacheable = (self._cache is not None and req.sampling.logprobs is None and req.tools is None
                         and self._cache.applies(req))
            if cacheable:
                hit = await self._cache.lookup(req, span)
                record.cache = "hit" if hit else "miss"
                if hit is not None:
                    text, finish = hit
                    ctx.headers[CACHE_HEADER] = "hit"  # HTTP header, gRPC metadata
                    if ctx.answer is not None:
                        ctx.answer.append(text)
                    record.ttft_ms = round((self._clock() - started) * 1000, 3)
                    self._count(record, finish)
                    yield Delta(text=_filtered(ctx.filters, text, last=True), tokens=finish.usage.completion_tokens)
                    yield finish
                    return
            parts = ctx.answer if ctx.answer is not None else [] if cacheable else None
            record.policy = ctx.policy.routing
            filters = ctx.filters
            gate = LogprobGate() if filters and req.sampling.logprobs is not None else None
            async with aclosing(self._answer(req, started + req.timeout_s, ctx)) as items:
                async for item in items:
                    if record.ttft_ms is None:
                        record.ttft_ms = round((self._clock() - started) * 1000, 3)
                    if isinstance(item, Delta):
                        if parts is not None:
                            parts.append(item.text)
                        if filters:
                            text = _filtered(filters, item.text)
                            item = Delta(text=text, tokens=item.tokens,
                                         logprobs=gate.feed(item.text, item.logprobs, text) if gate else (),
                                         tool_calls=item.tool_calls)  # their arguments are not rewritten
                    else:
                        self._count(record, item)
                        if cacheable:
                            self._background.spawn(self._cache.store(req, "".join(parts), item, span))
                        if filters:
                            tail = _filtered(filters, "", last=True)
                            rest = gate.feed("", (), tail, last=True) if gate else ()
                            if tail or rest:
                                yield Delta(text=tail, tokens=0, logprobs=rest)
                    yield item
        except LlmeshError as exc:
            record.status = exc.code.value
            record.reason = exc.reason
            span.set_status(Status(StatusCode.ERROR, exc.message))
            span.set_attribute("error.type", exc.reason or exc.code.value)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if record.finish_reason is None:  # a consumer that stops after the Finish was served in full
                record.status = "cancelled"
            raise
        finally:
            record.duration_ms = round((self._clock() - started) * 1000, 3)
            if entered:
                self._background.spawn(self._finish(entered, ctx))
            if log.isEnabledFor(logging.INFO):  # the record's fields are built only for a log that is on
                log.info("request", extra=record.log_fields())
            self._observe(record)
            end_span(span, record)

    @staticmethod
    async def _finish(entered: list[Stage], ctx: Context) -> None:
        for stage in reversed(entered):
            try:
                await stage.finish(ctx)
            except Exception:  # noqa: BLE001 - one stage's bookkeeping never stops the others'
                log.exception("stage finish failed", extra={"stage": type(stage).__name__})

    def _answer(self, req: CompletionRequest, deadline: float, ctx: Context) -> AsyncIterator[Delta | Finish]:
        if ctx.upstream is None:
            return self._generate(req, deadline, ctx.policy, ctx)
        # A stage answers (cascade); another model it asks gets that model's own policy.
        call = lambda r: self._generate(  # noqa: E731
            r, deadline, ctx.policy if r.model == req.model else self._config().policy(r.model), ctx)
        return ctx.upstream(req, call)

    def upstream(self, req: CompletionRequest) -> AsyncIterator[Delta | Finish]:
        """The model's answer without the stages, the cache or a client: for copies of a
        request that was already admitted (shadow). Its endpoints, retries and fallbacks
        per the model's policy, outside the retry budget, within ``req.timeout_s``."""
        ctx = Context(req, RequestRecord(req.model, req.tenant), INVALID_SPAN, policy=self._config().policy(req.model))
        return self._attempts(req, self._clock() + req.timeout_s, ctx.policy, ctx)

    async def _generate(self, req: CompletionRequest, deadline: float, policy: ModelPolicy, ctx: Context
                        ) -> AsyncIterator[Delta | Finish]:
        """The model's endpoints (or its provider), then each fallback model's, until one
        answers. Every attempt after the first is a retry, paid from the retry budget;
        breakers keep requests off endpoints and providers that fail or stall."""
        if self._budget is not None:
            self._budget.deposit()
        try:
            async with aclosing(self._attempts(req, deadline, policy, ctx)) as items:
                async for item in items:
                    yield item
        finally:
            if self._budget is not None:
                self._budget.leave()

    async def _attempts(self, req: CompletionRequest, deadline: float, policy: ModelPolicy, ctx: Context
                        ) -> AsyncIterator[Delta | Finish]:
        record = ctx.record
        state = _Attempts()
        config = self._config()
        emitted: list[str] = []
        work = work_tokens(req.prompt, req.sampling.max_tokens)  # what an engine's queue gains from it
        chain = (req.model, *policy.fallbacks)
        needs_tools = uses_tools(req.prompt, req.tools)
        for model in chain:
            last_model = model == chain[-1]
            if state.mid_stream is not None:
                raise state.mid_stream  # an answer under way is finished by its own model only
            target = req if model == req.model else replace(req, model=model)
            provider = config.provider_for(model) if self._providers is not None else None
            if provider is None and needs_tools is not None:
                # An llmesh engine cannot call tools: a fallback served by a provider may.
                state.last_error = InvalidArgument(
                    f"The model '{model}' is served by an llmesh engine, which cannot call tools; "
                    f"'{needs_tools}' needs a model served by an OpenAI-compatible provider.", param=needs_tools)
                continue
            tried: set[str] = set()
            for _ in range(1 if provider is not None else policy.max_attempts):
                now = self._clock()
                refusing = self._breakers.refusing(now) if self._breakers is not None else frozenset()
                if provider is not None:
                    key = f"provider:{provider[0]}"
                    if key in refusing:
                        break
                    call = lambda t, remaining, p=provider[1], m=model: self._providers.generate(  # noqa: E731
                        p, p.models[m], t, remaining)
                else:
                    pick = PickInput(model=model, now=now, exclude=frozenset(tried) | refusing, session=req.user,
                                     work_tokens=work, tokens=lambda m=model, t=target: self._prompt_tokens(m, t.prompt),
                                     max_tokens=target.sampling.max_tokens, filters=tuple(policy.filters))
                    endpoint = self._picker.pick(pick, policy.routing, policy.scorers)
                    if endpoint is None and refusing and last_model:
                        # Breakers move traffic elsewhere; with nowhere else to go they do not
                        # refuse the last option (Envoy's panic mode).
                        pick.exclude = frozenset(tried)
                        endpoint = self._picker.pick(pick, policy.routing, policy.scorers)
                        if endpoint is not None:
                            record.breaker_panic = True
                    if endpoint is None:
                        break
                    key = endpoint.endpoint_id
                    call = lambda t, remaining, a=endpoint.address: self._engines.generate(  # noqa: E731
                        a, t, remaining, ctx.span)
                if state.count:
                    # A continuation after a mid-stream failure is no retry: the answer is half given.
                    if self._budget is not None and not target.continuation and not self._budget.spend():
                        record.retry_budget_exhausted = True
                        raise self._refusal(state, req.model) or Unavailable("The retry budget is spent.",
                                                                             reason="retry_budget")
                    record.retries += 1
                state.count += 1
                tried.add(key)
                remaining = deadline - now
                if remaining <= 0:
                    raise DeadlineExceeded()
                record.endpoint = key
                if model != req.model:
                    record.model = model
                    record.fallback = model
                    ctx.headers[FALLBACK_HEADER] = model
                state.can_continue = provider is None
                async with aclosing(self._attempt(key, call(target, remaining), now, state, work)) as items:
                    async for item in items:
                        if isinstance(item, Delta):
                            emitted.append(item.text)
                            state.carried_tokens += item.tokens
                        elif record.failovers:  # usage over the whole answer, not the last leg
                            before = state.carried_before_leg
                            item = Finish(item.reason, Usage(max(0, item.usage.prompt_tokens - before),
                                                             item.usage.completion_tokens + before))
                        yield item
                if state.done:
                    return
                if state.mid_stream is not None:
                    # Continue on another engine from the prompt plus what the client already has.
                    record.failovers += 1
                    ctx.headers[FAILOVER_HEADER] = str(record.failovers)
                    state.carried_before_leg = state.carried_tokens
                    left = None if req.sampling.max_tokens is None else req.sampling.max_tokens - state.carried_tokens
                    if left is not None and left <= 0:  # it died between its last token and its finish
                        yield Finish(FinishReason.LENGTH, Usage(0, state.carried_tokens))
                        return
                    target = replace(target, continuation="".join(emitted),
                                     sampling=replace(target.sampling, max_tokens=left))
                    continue
                if state.next_model:
                    break
        if state.mid_stream is not None:
            raise state.mid_stream
        if (refusal := self._refusal(state, req.model)) is not None:
            raise refusal
        raise Unavailable(f"No healthy endpoint serves the model '{req.model}' right now.",
                          reason="no_healthy_endpoint")

    async def _attempt(self, key: str, items: AsyncIterator[Delta | Finish], started: float, state: _Attempts,
                       work: int = 0) -> AsyncIterator[Delta | Finish]:
        """One upstream call. Sets ``state.done`` when it answered; a failure before the
        first token is kept in ``state`` for the caller to try elsewhere, others raise."""
        if self._breakers is not None:
            self._breakers.attempt(key, started)
        self._picker.acquire(key, work)
        streamed = False
        state.next_model = False
        state.mid_stream = None
        try:
            async with aclosing(items):
                async for item in items:
                    if not streamed:
                        streamed = True
                        self._outcome(key, True, self._clock() - started)
                    yield item
            state.done = True
        except LlmeshError as exc:
            if isinstance(exc, DeadlineExceeded):
                # The client's deadline, not necessarily the endpoint's fault: it counts as that slow.
                self._outcome(key, True, self._clock() - started)
            elif isinstance(exc, ENDPOINT_FAILURES):
                self._outcome(key, False, None)
            if streamed:
                if state.can_continue and isinstance(exc, (Unavailable, Internal)):
                    if isinstance(exc, Unavailable):
                        self._picker.mark_down(key, self._clock())
                    state.mid_stream = state.last_error = exc
                    return
                raise
            if isinstance(exc, InvalidArgument) and exc.reason == "context_length_exceeded":
                state.last_error, state.next_model = exc, True  # a larger context may come next
                return
            if not isinstance(exc, (Unavailable, Overloaded)):
                raise
            if isinstance(exc, Unavailable):
                self._picker.mark_down(key, self._clock())
            else:
                state.busy = True
            state.last_error = exc
        finally:
            self._picker.release(key, work)

    def _refusal(self, state: _Attempts, model: str) -> LlmeshError | None:
        """What a request that no upstream took fails with. When any refused it for a full
        queue, capacity is there but busy: the client is told to come back (429 with
        Retry-After), not handed the last engine's refusal or a 503."""
        return QueueFull(model, self._retry_after_s) if state.busy else state.last_error

    def _outcome(self, endpoint: str, ok: bool, ttft_s: float | None) -> None:
        if self._breakers is not None:
            self._breakers.record(endpoint, ok, ttft_s, self._clock())

    @staticmethod
    def _count(record: RequestRecord, finish: Finish) -> None:
        record.prompt_tokens = finish.usage.prompt_tokens
        record.completion_tokens = finish.usage.completion_tokens
        record.finish_reason = finish.reason.value

    async def drain(self) -> None:
        await self._background.drain()



def _filtered(filters: list[OutputFilter], text: str, last: bool = False) -> str:
    for f in filters:
        text = f.feed(text)
        if last:
            text += f.flush()
    return text


def request_attributes(req: CompletionRequest) -> dict:
    """OpenTelemetry GenAI semantic-convention attributes known before the call."""
    s = req.sampling
    attrs = {"gen_ai.operation.name": req.operation, "gen_ai.request.model": req.model,
             "gen_ai.system": "llmesh", "llmesh.request_id": req.request_id, "llmesh.tenant": req.tenant}
    for key, value in (("gen_ai.request.max_tokens", s.max_tokens), ("gen_ai.request.temperature", s.temperature),
                       ("gen_ai.request.top_p", s.top_p), ("gen_ai.request.seed", s.seed)):
        if value is not None:
            attrs[key] = value
    return attrs


def end_span(span: Span, record: RequestRecord) -> None:
    span.set_attribute("gen_ai.response.model", record.model)
    span.set_attribute("gen_ai.usage.input_tokens", record.prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", record.completion_tokens)
    if record.finish_reason is not None:
        span.set_attribute("gen_ai.response.finish_reasons", [record.finish_reason])
    if record.endpoint:
        span.set_attribute("llmesh.endpoint", record.endpoint)
    span.set_attribute("llmesh.cache", record.cache)
    span.end()

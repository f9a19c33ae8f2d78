"""The terminal router: a request's answer from its model's endpoints (or the provider
that serves it), then from each fallback model's, until one answers.

- Endpoints come from the picker (the model policy's filters and scorers); breakers keep
  requests off endpoints and providers that fail or stall, and with nowhere else to go
  they refuse the last option no longer (Envoy's panic mode).
- A failure before the first token is tried elsewhere, up to the policy's attempts;
  every attempt after a request's first is a retry, paid from the retry budget.
- An engine that went away under the request before its first token (its process killed
  or crashed) may have been killed by it: the request goes to no other engine while that
  one may come back (``upstream.lost``); back within the hold, it is tried there once more
  (the same engine: not one more of ``max_attempts``), else elsewhere as an ordinary retry.
  An engine lost after the first token: the answer goes on on another replica (below).
  A second engine lost under the request, before or after its first token, refuses it
  (``PoisonRequest``, 400 naming the request id): it goes nowhere else, nor to a fallback.
- A context-length refusal moves on to the next model (a larger context may come next).
- An engine that dies mid-stream: the answer goes on on another replica of the same
  model, from the prompt plus the text the client already has.
- A request every upstream turned away for a full queue gets 429 with Retry-After.

Stages that wrap the upstream (``Context.wrap``) see it as an ``Upstream``: this
request's call, and ``detached`` for a copy apart from it. It has no gRPC in it: the
engines and providers are ports (``EngineClient``, ``ProviderPort``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import cast

from opentelemetry.trace import INVALID_SPAN

from llmesh.errors import (DeadlineExceeded, EngineLost, Internal, InvalidArgument, LlmeshError, NotEmbedding,
                           NotGenerative, Overloaded, PoisonRequest, QueueFull, Unavailable)
from llmesh.liveconfig.schema import MeshConfig, ModelPolicy, Provider
from llmesh.types import Delta, Finish, FinishReason, Priority, Usage
from llmesh.validation import uses_tools
from llmesh.gateway.context import CompletionRequest, Context, Items, Upstream, Wrap
from llmesh.gateway.record import RequestRecord
from llmesh.gateway.domain.prompt_tokens import NoTokens, RequestTokens, Tokenizer
from llmesh.gateway.upstream.ports import EngineClient, ProviderPort
from llmesh.gateway.upstream.lost import LostEngineHold
from llmesh.gateway.upstream.picking import EndpointPicker, PickInput
from llmesh.gateway.upstream.picking.types import work_tokens
from llmesh.gateway.upstream.resilience import Breakers, RetryBudgetGate

FALLBACK_HEADER = "x-llmesh-fallback"  # the model that answered, when it was a fallback
FAILOVER_HEADER = "x-llmesh-failover"  # how many times the answer moved to another engine mid-stream
ENDPOINT_FAILURES = (Unavailable, Internal)  # what counts against a breaker as a failure
MAX_ENGINES_LOST = 2  # losses under one request: the first, and the one retry after it (the same engine's)

log = logging.getLogger("llmesh.gateway.upstream")

Attempt = Callable[[CompletionRequest, float], Items]  # (request, seconds left) -> one upstream's answer


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
    lost: bool = False  # the last attempt's engine went away under it (EngineLost)
    incarnation: int | None = None  # then: that endpoint's incarnation (LostEngineHold) when it was lost
    only: str | None = None  # the next attempt goes to this endpoint only: it came back after a loss
    low: bool = False  # a lowest-priority request (a batch line): counted apart in the load ledger


def _carried(item: Delta | Finish, state: _Attempts, emitted: list[str], failovers: int) -> Delta | Finish:
    """An item of the answer, as the client gets it: a delta is kept for a failover to carry on from;
    after a failover, the finish's usage is over the whole answer, not the last leg."""
    if isinstance(item, Delta):
        emitted.append(item.text)
        state.carried_tokens += item.tokens
    elif failovers:
        before = state.carried_before_leg
        item = Finish(item.reason, Usage(max(0, item.usage.prompt_tokens - before),
                                         item.usage.completion_tokens + before))
    return item


class Router:
    def __init__(self, picker: EndpointPicker, engines: EngineClient, config: Callable[[], MeshConfig] = MeshConfig,
                 prompt_tokens: Tokenizer = NoTokens(), breakers: Breakers | None = None,
                 budget: RetryBudgetGate | None = None, providers: ProviderPort | None = None,
                 retry_after_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, lost_engine_hold_s: float = 30.0):
        self._picker = picker
        self._hold = LostEngineHold(picker, breakers, lambda address: self._engines.connected(address),
                                    lost_engine_hold_s, clock)
        self._engines = engines
        self._config = config
        self._prompt_tokens = prompt_tokens
        self._breakers = breakers
        self._budget = budget
        self._providers = providers
        self._retry_after_s = retry_after_s  # the hint a client gets when every queue is full
        self._clock = clock

    def answer(self, ctx: Context, deadline: float) -> Items:
        """``ctx.req``'s answer, through the wraps the stages put around the upstream."""
        if ctx.wraps is None:
            return self._attempts(ctx.req, deadline, ctx.policy, ctx, True)
        upstream: Upstream = _Bound(self, ctx, deadline)
        for wrap in ctx.wraps:
            upstream = _Wrapped(wrap, upstream)
        return upstream(ctx.req)

    def call(self, req: CompletionRequest, ctx: Context, deadline: float) -> Items:
        """``req`` (the request's model, or another a stage asks) within ``ctx``'s request."""
        policy = ctx.policy if req.model == ctx.req.model else self._config().policy(req.model)
        return self._attempts(req, deadline, policy, ctx, True)

    def detached(self, req: CompletionRequest) -> Items:
        """The model's answer to a copy of an admitted request (shadow): its endpoints,
        retries and fallbacks per the model's policy, outside the retry budget, within
        ``req.timeout_s``."""
        ctx = Context(req, RequestRecord(req.model, req.tenant), INVALID_SPAN, policy=self._config().policy(req.model))
        return self._attempts(req, self._clock() + req.timeout_s, ctx.policy, ctx, False)

    async def _attempts(self, req: CompletionRequest, deadline: float, policy: ModelPolicy, ctx: Context,
                        paid: bool) -> Items:
        """The model's endpoints (or its provider), then each fallback model's, until one
        answers. ``paid``: the request pays into the retry budget while it runs."""
        budget = self._budget if paid else None
        if budget is not None:
            budget.deposit()
        try:
            (record := ctx.record).policy = ctx.policy.routing
            state, emitted = _Attempts(low=req.priority is Priority.LOW), list[str]()
            work = work_tokens(req.prompt, req.sampling.max_tokens, inputs=req.inputs)  # what a queue gains from it
            chain = (req.model, *policy.fallbacks)
            needs_tools = uses_tools(req.prompt, req.tools)
            tokens = ctx.tokens
            if tokens is None or not tokens.serves(req.prompt, req.tools):  # none counted, or masked since
                tokens = RequestTokens(self._prompt_tokens, req.prompt, req.tools)
            config = self._config()
            for model in chain:
                if state.mid_stream is not None:
                    raise state.mid_stream  # an answer under way is finished by its own model only
                target = req if model == req.model else replace(req, model=model)
                provider = config.provider_for(model) if self._providers is not None else None
                if (skip := self._cannot_serve(model, provider is not None, needs_tools, req.embeds)) is not None:
                    state.last_error = skip  # a fallback may
                    continue
                tried: set[str] = set()
                engines = 1 if provider is not None else policy.max_attempts
                if provider is None and self._picker.reads_prompt(policy.routing, policy.scorers, policy.filters):
                    await tokens.ready(model)
                while len(tried) < engines or state.only is not None:  # a lost engine's second try is no new one
                    now = self._clock()
                    chosen = self._choose(model, provider, target, policy, tried, now, work, model == chain[-1], ctx,
                                          tokens.of(model), state.only)
                    state.only = None
                    if chosen is None:
                        break
                    key, call = chosen
                    remaining = self._begin(state, key, model, target, req, tried, deadline - now, ctx)
                    state.can_continue = provider is None and not req.embeds and needs_tools is None
                    async with aclosing(self._attempt(key, call(target, remaining), now, state, work)) as items:
                        async for item in items:
                            yield _carried(item, state, emitted, record.failovers)
                    if state.lost:
                        state.only = await self._lost(ctx, req, key, model, state, deadline)
                    if state.done:
                        return
                    if state.mid_stream is not None:
                        target = self._failover(target, req, state, emitted, ctx)
                        if target is None:  # it died between its last token and its finish
                            yield Finish(FinishReason.LENGTH, Usage(0, state.carried_tokens))
                            return
                        continue
                    if state.next_model:
                        break
            raise self._failure(state, req)
        finally:
            if budget is not None:
                budget.leave()

    def _choose(self, model: str, provider: tuple[str, Provider] | None, target: CompletionRequest,
                policy: ModelPolicy, tried: set[str], now: float, work: int, last_model: bool, ctx: Context,
                tokens: Callable[[], Sequence[int]], only: str | None = None) -> tuple[str, Attempt] | None:
        """The next upstream to try for ``model`` (``only``: that endpoint or none): its key
        (for breakers and the record) and the call; None when there is none left."""
        refusing = self._breakers.refusing(now) if self._breakers is not None else frozenset()
        if provider is not None:
            key = f"provider:{provider[0]}"
            if key in refusing:
                return None
            p, providers = provider[1], cast(ProviderPort, self._providers)  # found only with a port
            return key, lambda t, remaining: providers.generate(p, p.models[model], t, remaining)
        pick = PickInput(model=model, now=now, exclude=frozenset(tried) | refusing, session=target.user,
                         work_tokens=work, tokens=tokens, max_tokens=target.sampling.max_tokens,
                         filters=tuple(policy.filters), embed=target.embeds,
                         tools=uses_tools(target.prompt, target.tools) is not None)
        if only is not None:
            pick.exclude = refusing
            endpoint = self._picker.routable(only, pick)
        else:
            endpoint = self._picker.pick(pick, policy.routing, policy.scorers)
        if endpoint is None and refusing and last_model and only is None:
            # Breakers move traffic elsewhere; with nowhere else to go they do not
            # refuse the last option (Envoy's panic mode).
            pick.exclude = frozenset(tried)
            endpoint = self._picker.pick(pick, policy.routing, policy.scorers)
            if endpoint is not None:
                ctx.record.breaker_panic = True
        if endpoint is None:
            return None
        address, engines = endpoint.address, self._engines
        call = engines.embed if target.embeds else engines.generate
        return endpoint.endpoint_id, lambda t, remaining: call(address, t, remaining, ctx.span)

    def _begin(self, state: _Attempts, key: str, model: str, target: CompletionRequest, req: CompletionRequest,
               tried: set[str], remaining: float, ctx: Context) -> float:
        """Books an attempt on ``key``; raises when the retry budget or the deadline says no."""
        record = ctx.record
        if state.count:
            # A continuation after a mid-stream failure is no retry: the answer is half given.
            if self._budget is not None and not target.continuation and not self._budget.spend():
                record.retry_budget_exhausted = True
                raise self._refusal(state, req.model) or Unavailable("The retry budget is spent.",
                                                                     reason="retry_budget")
            record.retries += 1
        state.count += 1
        tried.add(key)
        if remaining <= 0:
            raise DeadlineExceeded()
        record.endpoint = key
        if model != req.model:
            record.model = model
            record.fallback = model
            ctx.headers[FALLBACK_HEADER] = model
        return remaining

    async def _attempt(self, key: str, items: Items, started: float, state: _Attempts, work: int) -> Items:
        """One upstream call. Sets ``state.done`` when it answered; a failure before the
        first token is kept in ``state`` for the caller to try elsewhere, others raise."""
        if self._breakers is not None:
            self._breakers.attempt(key, started)
        ticket, streamed = self._picker.acquire(key, work, low=state.low), False
        state.next_model = state.lost = False
        state.mid_stream = None
        try:
            async with aclosing(items):
                async for item in items:
                    if not streamed:
                        streamed = True
                        self._picker.started(ticket)  # the load ledger: its prefill is done
                        self._outcome(key, True, self._clock() - started)
                    yield item
            state.done = True
        except LlmeshError as exc:
            state.lost = isinstance(exc, EngineLost)
            if state.lost:
                state.incarnation = self._hold.incarnation(key)
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
            self._picker.release(key, work, ticket)

    async def _lost(self, ctx: Context, req: CompletionRequest, key: str, model: str, state: _Attempts,
                    deadline: float) -> str | None:
        """Counts the engine lost under ``req`` (a second loss refuses it); one lost before the
        first token is waited for: its key when it came back within the hold, for the next
        attempt to go there only."""
        self._engine_lost(ctx, req, key)
        if state.mid_stream is not None:
            return None  # after the first token: the answer goes on on another replica
        log.info("engine lost before the first token: waiting for it to come back", extra={
            "request_id": req.request_id, "endpoint": key, "hold_s": self._hold.hold_s})
        back = await self._hold.back(key, model, state.incarnation, deadline)
        if not back:
            log.warning("a lost engine did not come back within the hold: the request may go elsewhere", extra={
                "request_id": req.request_id, "endpoint": key, "hold_s": self._hold.hold_s})
        return key if back else None

    @staticmethod
    def _engine_lost(ctx: Context, req: CompletionRequest, key: str) -> None:
        """Counts an engine that went away under the request (before or after its first
        token); at the second the request goes nowhere else."""
        record = ctx.record
        record.engines_lost += 1
        if record.engines_lost >= MAX_ENGINES_LOST:
            log.warning("request refused: engines went away under it", extra={
                "request_id": req.request_id, "model": record.model, "endpoint": key,
                "engines_lost": record.engines_lost})
            raise PoisonRequest(req.request_id, record.engines_lost)

    @staticmethod
    def _failover(target: CompletionRequest, req: CompletionRequest, state: _Attempts, emitted: list[str],
                  ctx: Context) -> CompletionRequest | None:
        """The request that continues an answer whose engine died: the prompt plus what
        the client already has; None when the answer has no tokens left to give."""
        record = ctx.record
        record.failovers += 1
        ctx.headers[FAILOVER_HEADER] = str(record.failovers)
        state.carried_before_leg = state.carried_tokens
        left = None if req.sampling.max_tokens is None else req.sampling.max_tokens - state.carried_tokens
        if left is not None and left <= 0:
            return None
        return replace(target, continuation="".join(emitted), sampling=replace(target.sampling, max_tokens=left))

    def _failure(self, state: _Attempts, req: CompletionRequest) -> LlmeshError:
        if state.mid_stream is not None:
            return state.mid_stream
        model = req.model
        if not state.count and state.last_error is None:  # no endpoint at all: one of the other kind?
            if req.embeds and model in self._picker.generative_models():
                return NotEmbedding(model)
            if not req.embeds and model in self._picker.embedding_models():
                return NotGenerative(model)
        return self._refusal(state, model) or Unavailable(
            f"No healthy endpoint serves the model '{model}' right now.", reason="no_healthy_endpoint")

    def _refusal(self, state: _Attempts, model: str) -> LlmeshError | None:
        """What a request that no upstream took fails with. When any refused it for a full
        queue, capacity is there but busy: the client is told to come back (429 with
        Retry-After), not handed the last engine's refusal or a 503."""
        return QueueFull(model, self._retry_after_s) if state.busy else state.last_error

    def _cannot_serve(self, model: str, by_provider: bool, needs_tools: str | None, embeds: bool) -> LlmeshError | None:
        """Why ``model`` cannot answer the request at all: tools need a provider or an engine whose
        backend calls them (as engines report it), and providers answer generation only here."""
        if needs_tools is not None and not by_provider and model not in self._picker.tool_models():
            return _cannot_call_tools(model, needs_tools)
        return NotEmbedding(model) if by_provider and embeds else None

    def _outcome(self, endpoint: str, ok: bool, ttft_s: float | None) -> None:
        if self._breakers is not None:
            self._breakers.record(endpoint, ok, ttft_s, self._clock())


def _cannot_call_tools(model: str, needs: str) -> InvalidArgument:
    return InvalidArgument(f"The model '{model}' is served by llmesh engines whose backend cannot call tools; "
                           f"'{needs}' needs an engine that can (llamacpp) or an OpenAI-compatible provider.",
                           param=needs)


class _Bound:
    """The router as one request's innermost wrap sees it."""
    __slots__ = ("_router", "_ctx", "_deadline")

    def __init__(self, router: Router, ctx: Context, deadline: float):
        self._router, self._ctx, self._deadline = router, ctx, deadline

    def __call__(self, req: CompletionRequest) -> Items:
        return self._router.call(req, self._ctx, self._deadline)

    def detached(self, req: CompletionRequest) -> Items:
        return self._router.detached(req)


class _Wrapped:
    """The upstream with one more wrap around it."""
    __slots__ = ("_wrap", "_inner")

    def __init__(self, wrap: Wrap, inner: Upstream):
        self._wrap, self._inner = wrap, inner

    def __call__(self, req: CompletionRequest) -> Items:
        return self._wrap(req, self._inner)

    def detached(self, req: CompletionRequest) -> Items:
        return self._inner.detached(req)

"""One request's way through the gateway, shared by the HTTP and gRPC fronts, like
Envoy's filter chain: the stages admit the request in order (each may refuse, rewrite
or annotate it, add an output filter, wrap the upstream), the upstream router answers
it (``upstream.router``), the output filters rewrite the answer as it streams
(``output``), and the stages that care are told the outcome, last first, in the
background. The pipeline only orchestrates; every concern is a stage (``stages/``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import aclosing

from opentelemetry.trace import INVALID_SPAN, NoOpTracer, SpanKind, Status, StatusCode, Tracer

from llmesh.background import Background
from llmesh.errors import LlmeshError
from llmesh.liveconfig.schema import MeshConfig
from llmesh.telemetry import bind_trace_id, extract
from llmesh.types import Delta, Finish
from llmesh.gateway.context import Catalog, CompletionRequest, Context, Items
from llmesh.gateway.output import LogprobGate, filtered, tail
from llmesh.gateway.record import RequestRecord, clipped
from llmesh.gateway.spans import end_span, request_attributes
from llmesh.gateway.stages.base import Stage, finishes
from llmesh.gateway.stages.cache import CacheStage, ResponseCache
from llmesh.gateway.stages.route import RouteStage
from llmesh.gateway.stages.validate import ValidateStage
from llmesh.gateway.upstream.picking import EndpointPicker
from llmesh.gateway.upstream.resilience import Breakers, RetryBudgetGate
from llmesh.gateway.domain.prompt_tokens import NoTokens, Tokenizer
from llmesh.gateway.upstream.ports import EngineClient, ProviderPort
from llmesh.gateway.upstream.router import Router

log = logging.getLogger("llmesh.gateway.access")
_NONE = 1 << 30  # "no stage finishes": past any count of admitted stages


class Pipeline:
    """``stages`` run in order (by default: validate, route); a ``cache`` given here is
    looked up after them. The other arguments make the upstream router."""

    def __init__(self, picker: EndpointPicker, engines: EngineClient, catalog: Catalog,
                 cache: ResponseCache | None = None, config: Callable[[], MeshConfig] = MeshConfig,
                 observe: Callable[[RequestRecord], None] = lambda record: None, tracer: Tracer | None = None,
                 clock: Callable[[], float] = time.monotonic, stages: Sequence[Stage] | None = None,
                 prompt_tokens: Tokenizer = NoTokens(),
                 breakers: Breakers | None = None, budget: RetryBudgetGate | None = None,
                 providers: ProviderPort | None = None, retry_after_s: float = 1.0, lost_engine_hold_s: float = 30.0):
        self._stages = list(stages) if stages is not None else [ValidateStage(), RouteStage(catalog, config)]
        if cache is not None:
            self._stages.append(CacheStage(cache, config))
        self._router = Router(picker, engines, config, prompt_tokens, breakers, budget, providers, retry_after_s,
                              clock, lost_engine_hold_s)
        self._finishing = [i for i, stage in enumerate(self._stages) if finishes(stage)]
        self._front_refusals = [stage for stage in self._stages if getattr(stage, "front_refusals", False)]
        self._first_finishing = self._finishing[0] if self._finishing else _NONE
        self._observe = observe
        self._tracer = tracer or NoOpTracer()
        self._clock = clock
        self._background = Background()

    async def run(self, req: CompletionRequest, ctx: Context | None = None) -> Items:
        """Yields text deltas then one Finish; raises a LlmeshError on failure.
        Pass a ``ctx`` to read what the stages said (headers) once the first item came."""
        started = self._clock()
        record = RequestRecord(model=clipped(req.model), tenant=req.tenant)
        if req.client_request_id is not None:
            record.client_request_id = req.client_request_id
        span = self._tracer.start_span(f"{req.operation} {record.model}", context=extract(req.trace_headers),
                                       kind=SpanKind.SERVER if req.trace_headers is not None else SpanKind.INTERNAL,
                                       attributes=request_attributes(req))
        bind_trace_id(span)
        if ctx is None:
            ctx = Context(req, record, span)
        else:
            ctx.req, ctx.record, ctx.span = req, record, span
        ctx.asked = req.model
        admitted = 0
        try:
            for stage in self._stages:
                admitted += 1
                await stage.admit(ctx)
            filters = ctx.filters
            gate = LogprobGate() if filters and ctx.req.sampling.logprobs is not None else None
            async with aclosing(self._router.answer(ctx, started + ctx.req.timeout_s)) as items:
                async for item in items:
                    if record.ttft_ms is None:
                        record.ttft_ms = round((self._clock() - started) * 1000, 3)
                    if isinstance(item, Delta):
                        if filters:
                            item = filtered(filters, gate, item)
                    else:
                        _count(record, item)
                        if filters and (rest := tail(filters, gate)) is not None:
                            yield rest
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
            if admitted > self._first_finishing:
                self._background.spawn(self._finish(admitted, ctx))
            if log.isEnabledFor(logging.INFO):  # the record's fields are built only for a log that is on
                log.info("request", extra=record.log_fields())
            self._observe(record)
            end_span(span, record)

    def refused(self, req: CompletionRequest, exc: LlmeshError, started: float | None = None) -> None:
        """A request its front refused before the stages saw it (a body it could not read or
        parse, over the limit, breaking the protocol's rules): logged and counted as any request,
        and its record goes to the stages that keep one of every request (the audit). ``req``
        carries what the front knew: the request id, operation and client id, the model when
        the body said one."""
        record = RequestRecord(model=clipped(req.model), tenant=req.tenant)
        if req.client_request_id is not None:
            record.client_request_id = req.client_request_id
        record.status, record.reason = exc.code.value, exc.reason
        record.duration_ms = round((self._clock() - started) * 1000, 3) if started is not None else 0.0
        if self._front_refusals:
            self._background.spawn(self._finish_refused(Context(req, record, INVALID_SPAN)))
        if log.isEnabledFor(logging.INFO):
            log.info("request", extra=record.log_fields())
        self._observe(record)

    async def _finish_refused(self, ctx: Context) -> None:
        for stage in self._front_refusals:
            try:
                await stage.finish(ctx)
            except Exception:  # as in _finish: logged, the others go on
                log.exception("stage finish failed", extra={"stage": type(stage).__name__})

    async def _finish(self, admitted: int, ctx: Context) -> None:
        for i in reversed(self._finishing):
            if i < admitted:
                stage = self._stages[i]
                try:
                    await stage.finish(ctx)
                except Exception:  # one stage's bookkeeping never stops the others' (logged)
                    log.exception("stage finish failed", extra={"stage": type(stage).__name__})

    async def drain(self) -> None:
        """Waits for the stages' finishes and the work they left (the cache's stores)."""
        await self._background.drain()
        for stage in self._stages:
            if isinstance(stage, Stage):
                await stage.drain()


def _count(record: RequestRecord, finish: Finish) -> None:
    record.finish_reason = finish.reason.value
    if record.cache == "hit":  # nothing was spent: the cache stage noted what the hit saved
        return
    record.prompt_tokens = finish.usage.prompt_tokens
    record.completion_tokens = finish.usage.completion_tokens

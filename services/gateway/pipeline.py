"""One request's way through the gateway, shared by the HTTP and gRPC fronts:
validate -> known model -> cache -> pick endpoint -> stream from the engine
(retrying elsewhere before the first token) -> cache store, access log.

It talks to the other services through the small ports below, so it has no
gRPC in it and tests can drive it with real or in-process adapters."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Protocol

from opentelemetry.trace import NoOpTracer, Span, SpanKind, Status, StatusCode, Tracer

from llmesh.errors import DeadlineExceeded, LlmeshError, ModelNotFound, Overloaded, Unavailable
from llmesh.liveconfig.schema import MeshConfig, ModelPolicy
from llmesh.telemetry import bind_trace_id, extract
from llmesh.types import CachedText, Delta, Finish, Prompt, Sampling
from llmesh.validation import check_request
from llmesh.gateway.endpoints import EndpointPicker
from llmesh.gateway.policy import apply_policy, route

log = logging.getLogger("llmesh.gateway.access")


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


class EngineClient(Protocol):
    def generate(self, address: str, req: CompletionRequest, timeout_s: float, parent: Span
                 ) -> AsyncIterator[Delta | Finish]: ...


class ResponseCache(Protocol):
    async def lookup(self, req: CompletionRequest, parent: Span) -> tuple[str, Finish] | None: ...
    async def store(self, req: CompletionRequest, text: str, finish: Finish, parent: Span) -> None: ...


class Catalog(Protocol):
    def known(self, model: str) -> bool: ...


class Pipeline:
    def __init__(self, picker: EndpointPicker, engines: EngineClient, catalog: Catalog,
                 cache: ResponseCache | None = None,
                 config: Callable[[], MeshConfig] = MeshConfig,
                 observe: Callable[[dict], None] = lambda record: None,
                 tracer: Tracer | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._picker = picker
        self._engines = engines
        self._catalog = catalog
        self._cache = cache
        self._config = config
        self._observe = observe
        self._tracer = tracer or NoOpTracer()
        self._clock = clock
        self._background: set[asyncio.Task] = set()

    async def run(self, req: CompletionRequest) -> AsyncIterator[Delta | Finish]:
        """Yields text deltas then one Finish; raises a LlmeshError on failure."""
        started = self._clock()
        record = {"model": req.model, "tenant": req.tenant, "endpoint": None, "cache": "skip",
                  "status": "ok", "ttft_ms": None, "prompt_tokens": 0, "completion_tokens": 0, "retries": 0}
        span = self._tracer.start_span(f"{req.operation} {req.model}", context=extract(req.trace_headers),
                                       kind=SpanKind.SERVER if req.trace_headers is not None else SpanKind.INTERNAL,
                                       attributes=request_attributes(req))
        bind_trace_id(span)
        try:
            check_request(req.model, req.prompt, req.sampling)
            target, policy = route(req.model, self._config(), req.user or req.request_id)
            if not self._catalog.known(target):
                raise ModelNotFound(req.model)
            prompt, sampling = apply_policy(req.prompt, req.sampling, policy)
            req = replace(req, model=target, prompt=prompt, sampling=sampling)
            record["model"] = target
            cacheable = self._cache is not None and self._config().cache.applies(
                req.tenant, req.model, req.sampling.deterministic)
            if cacheable:
                hit = await self._cache.lookup(req, span)
                record["cache"] = "hit" if hit else "miss"
                if hit is not None:
                    text, finish = hit
                    record["ttft_ms"] = round((self._clock() - started) * 1000, 3)
                    self._count(record, finish)
                    yield CachedText(text=text, tokens=finish.usage.completion_tokens)
                    yield finish
                    return
            parts: list[str] = []
            record["policy"] = policy.routing
            async with aclosing(self._generate(req, started + req.timeout_s, policy, record, span)) as items:
                async for item in items:
                    if record["ttft_ms"] is None:
                        record["ttft_ms"] = round((self._clock() - started) * 1000, 3)
                    if isinstance(item, Delta):
                        if cacheable:
                            parts.append(item.text)
                    else:
                        self._count(record, item)
                        if cacheable:
                            self._spawn(self._cache.store(req, "".join(parts), item, span))
                    yield item
        except LlmeshError as exc:
            record["status"] = exc.code.value
            span.set_status(Status(StatusCode.ERROR, exc.message))
            span.set_attribute("error.type", exc.reason or exc.code.value)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            record["status"] = "cancelled"
            raise
        finally:
            record["duration_ms"] = round((self._clock() - started) * 1000, 3)
            log.info("request", extra=record)
            self._observe(record)
            end_span(span, record)

    async def _generate(self, req: CompletionRequest, deadline: float, policy: ModelPolicy, record: dict,
                        span: Span) -> AsyncIterator[Delta | Finish]:
        tried: set[str] = set()
        last_error: LlmeshError | None = None
        for _ in range(policy.max_attempts):
            endpoint = self._picker.pick(req.model, self._clock(), frozenset(tried), policy.routing)
            if endpoint is None:
                break
            if tried:
                record["retries"] += 1
            tried.add(endpoint.endpoint_id)
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise DeadlineExceeded()
            record["endpoint"] = endpoint.endpoint_id
            self._picker.acquire(endpoint.endpoint_id)
            streamed = False
            try:
                async with aclosing(self._engines.generate(endpoint.address, req, remaining, span)) as items:
                    async for item in items:
                        streamed = True
                        yield item
                return
            except (Unavailable, Overloaded) as exc:
                if streamed:
                    raise
                if isinstance(exc, Unavailable):
                    self._picker.mark_down(endpoint.endpoint_id, self._clock())
                last_error = exc
            finally:
                self._picker.release(endpoint.endpoint_id)
        if last_error is not None:
            raise last_error
        raise Unavailable(f"No healthy endpoint serves the model '{req.model}' right now.",
                          reason="no_healthy_endpoint")

    @staticmethod
    def _count(record: dict, finish: Finish) -> None:
        record["prompt_tokens"] = finish.usage.prompt_tokens
        record["completion_tokens"] = finish.usage.completion_tokens
        record["finish_reason"] = finish.reason.value

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)



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


def end_span(span: Span, record: dict) -> None:
    span.set_attribute("gen_ai.response.model", record["model"])
    span.set_attribute("gen_ai.usage.input_tokens", record["prompt_tokens"])
    span.set_attribute("gen_ai.usage.output_tokens", record["completion_tokens"])
    if "finish_reason" in record:
        span.set_attribute("gen_ai.response.finish_reasons", [record["finish_reason"]])
    if record["endpoint"]:
        span.set_attribute("llmesh.endpoint", record["endpoint"])
    span.set_attribute("llmesh.cache", record["cache"])
    span.end()

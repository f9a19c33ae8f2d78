"""Tracing with the OpenTelemetry SDK: W3C trace context in gRPC metadata (and HTTP
headers) across every hop, OTLP export configured by the standard OTEL_* variables.

Off unless an OTLP endpoint is configured (OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); then the no-op tracer costs next to nothing on
the request path. Sampling: OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG, read by
the SDK. GenAI attributes follow the OpenTelemetry semantic conventions."""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

_PROPAGATOR = TraceContextTextMapPropagator()
trace_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("trace_id", default=None)

__all__ = ["SpanKind", "Tracer", "build_tracer", "child_context", "extract", "inject", "trace_id_var"]


class Tracing:
    """The process's tracer and, when exporting, the provider to flush on stop."""

    def __init__(self, tracer: Tracer, provider: TracerProvider | None = None):
        self.tracer = tracer
        self._provider = provider

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


def build_tracer(service: str) -> Tracing:
    exporting = (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    if not exporting or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true" \
            or os.environ.get("OTEL_TRACES_EXPORTER", "otlp") == "none":
        return Tracing(trace.NoOpTracer())
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", f"llmesh-{service}"),
                                "service.namespace": "llmesh"})
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return Tracing(provider.get_tracer("llmesh"), provider)


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> Context | None:
    """The remote parent from HTTP headers or gRPC metadata, if any."""
    if not carrier:
        return None
    items = dict(carrier.items() if isinstance(carrier, Mapping) else carrier)
    if "traceparent" not in items:
        return None
    return _PROPAGATOR.extract(items)


def inject(span: Span) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that makes ``span`` the parent on the other side."""
    if not span.get_span_context().is_valid:
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def child_context(span: Span) -> Context:
    return trace.set_span_in_context(span)


def bind_trace_id(span: Span) -> None:
    """Put the span's trace id on every log line of this task from now on."""
    ctx = span.get_span_context()
    if ctx.is_valid:
        trace_id_var.set(format(ctx.trace_id, "032x"))

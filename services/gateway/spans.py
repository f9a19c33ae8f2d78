"""A request's span: OpenTelemetry GenAI semantic-convention attributes, those known
before the call and those the record holds at its end."""

from __future__ import annotations

from opentelemetry.trace import Span

from llmesh.gateway.context import CompletionRequest
from llmesh.gateway.record import RequestRecord, clipped


def request_attributes(req: CompletionRequest) -> dict[str, str | int | float]:
    """OpenTelemetry GenAI semantic-convention attributes known before the call."""
    s = req.sampling
    attrs: dict[str, str | int | float] = {
        "gen_ai.operation.name": req.operation, "gen_ai.request.model": clipped(req.model),
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

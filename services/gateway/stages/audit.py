"""The audit stage: one hash-chained record per request, refused ones included
(who, when, model, tokens, cost, decision; never the prompt or the answer). It
is the first stage, so its ``finish`` runs last and sees every other stage's
annotations.

Whatever a client sends, its request gets its record: every value is fitted to the
log's limits first (strings cut to ``MAX_STRING`` characters, lists and maps to
``MAX_ITEMS``), and a record the log still refuses is written with its core fields
only, escaped. A record that cannot be written at all (the log's file failed) is counted
(``on_failure``) and logged, without the prompt. With ``required`` (the gateway's
``audit_required``) a request is refused (503, ``audit_unavailable``) before it
reaches an engine while the log cannot be written: no request is served unaudited,
except those already under way when a write fails (their batch is lost, and counted)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from llmesh.audit import MAX_ITEMS, MAX_STRING, AuditError, AuditLog
from llmesh.errors import Unavailable
from llmesh.gateway.context import Context
from llmesh.gateway.stages.base import Stage

log = logging.getLogger("llmesh.gateway.audit")
_CORE = ("request_id", "tenant", "model", "operation", "status", "decision")


class AuditStage(Stage):
    front_refusals = True  # a request the front refused (a bad body) gets its record too

    def __init__(self, log: AuditLog, required: bool = False, on_failure: Callable[[], None] = lambda: None):
        self._log = log
        self._required = required
        self._on_failure = on_failure  # one record not written

    async def admit(self, ctx: Context) -> None:
        if self._required and not self._log.writable:
            raise Unavailable("The audit log cannot be written, and this gateway serves no request it cannot "
                              "audit (audit_required); retry later.", reason="audit_unavailable")

    async def finish(self, ctx: Context) -> None:
        fields = record_fields(ctx)
        try:
            try:
                self._log.append("request", fields)
            except ValueError as exc:  # a value the log refuses even fitted: the core still goes in
                log.warning("audit record written with its core fields only",
                            extra={"request_id": ctx.req.request_id, "error": str(exc)})
                self._log.append("request", {name: _escaped(fields[name]) for name in _CORE})
        except (AuditError, ValueError) as exc:
            self._on_failure()
            log.error("audit record not written", extra={"request_id": ctx.req.request_id, "error": str(exc)})


def record_fields(ctx: Context) -> dict[str, object]:
    """The request's audit record, every value fitted to the log's limits."""
    r, req = ctx.record, ctx.req
    fields: dict[str, object] = {
        "request_id": req.request_id, "tenant": r.tenant or "", "model": r.model,
        "operation": req.operation, "status": r.status,
        "decision": "allowed" if r.status in ("ok", "cancelled") or r.ttft_ms is not None else "refused",
        "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
        "latency_ms": r.duration_ms, "cache": r.cache, "priority": req.priority.name.lower(),
    }
    if req.caller.method != "local":
        fields["key_id" if req.caller.method == "api_key" else "subject"] = req.caller.subject
    if req.caller.groups:
        fields["groups"] = list(req.caller.groups)
    for name, value in (("reason", r.reason), ("endpoint", r.endpoint), ("cost", r.cost_usd), ("pii", r.pii),
                        ("injection_score", r.injection_score), ("injection_rules", r.injection_rules),
                        ("client_request_id", r.client_request_id)):
        if value is not None:
            fields[name] = value
    if r.injection_truncated:
        fields["injection_truncated"] = True
    if r.cache_kind is not None:  # a hit: what it did not spend (``llmesh usage`` sums these)
        fields.update(cache_kind=r.cache_kind, saved_prompt_tokens=r.saved_prompt_tokens,
                      saved_completion_tokens=r.saved_completion_tokens, saved_cost=r.saved_usd or 0.0)
    return {name: _fit(value) for name, value in fields.items()}


def _escaped(value: object) -> object:
    """A string as printable ASCII (``\\x..``, ``\\u....`` escapes), which any log takes."""
    return ascii(value)[1:-1][:MAX_STRING] if isinstance(value, str) else value


def _fit(value: object) -> object:
    if isinstance(value, str):
        return value[:MAX_STRING]
    if isinstance(value, list):
        return [_fit(item) for item in value[:MAX_ITEMS]]
    if isinstance(value, dict):
        return {str(k)[:MAX_STRING]: v for k, v in list(value.items())[:MAX_ITEMS]}
    return value

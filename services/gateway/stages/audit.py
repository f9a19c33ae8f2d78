"""The audit stage: one hash-chained record per request, refused ones included
(who, when, model, tokens, cost, decision; never the prompt or the answer). It
is the first stage, so its ``finish`` runs last and sees every other stage's
annotations."""

from __future__ import annotations

from llmesh.audit import AuditLog
from llmesh.gateway.context import Context
from llmesh.gateway.stages.base import Stage


class AuditStage(Stage):
    def __init__(self, log: AuditLog):
        self._log = log

    async def finish(self, ctx: Context) -> None:
        r, req = ctx.record, ctx.req
        fields = {
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
                            ("injection_score", r.injection_score), ("injection_rules", r.injection_rules)):
            if value is not None:
                fields[name] = value
        if r.injection_truncated:
            fields["injection_truncated"] = True
        self._log.append("request", fields)

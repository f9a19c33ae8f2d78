"""The request's values against the API's rules (lengths, ranges, tools), before any
stage spends anything on it."""

from __future__ import annotations

from llmesh.validation import check_embed, check_request
from llmesh.gateway.context import Context
from llmesh.gateway.stages.base import Stage


class ValidateStage(Stage):
    async def admit(self, ctx: Context) -> None:
        req = ctx.req
        if req.inputs is not None:  # an embeddings request: the EmbedRequest rules
            if not req.checked:
                check_embed(req.model, req.inputs, req.user, req.dimensions)
            return
        check_request(req.model, req.prompt, req.sampling, user=req.user, tools=req.tools, tools_allowed=True,
                      rules_checked=req.checked)

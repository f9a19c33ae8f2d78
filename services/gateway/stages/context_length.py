"""The context-length stage: a prompt that cannot fit the model's context is refused
(400 ``context_length_exceeded``) before anything whose cost grows with the prompt runs
(token counting for limits, the guards, the cache key), and cheaply: a floor on the
prompt's tokens that counts no further than the context (``PromptTokens.floor``).

The context is the largest one the model's engines report (and of every model in its
fallback chain: a larger context may come next). A model whose context is unknown (no
engine reported one, a provider's model) or whose tokenizer the gateway lacks is not
checked here; its engine checks the exact count, as before."""

from __future__ import annotations

from collections.abc import Callable

from llmesh.errors import InvalidArgument
from llmesh.liveconfig.schema import MeshConfig
from llmesh.types import Prompt
from llmesh.gateway.context import Context
from llmesh.gateway.stages.base import Stage


class ContextLengthStage(Stage):
    def __init__(self, context_length: Callable[[str], int | None], floor: Callable[[str, Prompt, int], int],
                 config: Callable[[], MeshConfig]):
        self._context_length = context_length  # a model's largest reported context, None: unknown
        self._floor = floor  # at least this many prompt tokens, counting to the third argument at most
        self._config = config

    async def admit(self, ctx: Context) -> None:
        """Refuses the request when its prompt cannot fit the model, nor any model of its fallback
        chain (each counted with its own tokenizer)."""
        req = ctx.req
        if req.embeds:
            return  # each input is checked against the model's limit by its engine, exactly
        config = self._config()
        completion = req.sampling.max_tokens or 1
        refusal = None
        for model in (req.model, *ctx.policy.fallbacks):
            limit = self._context_length(model) if config.provider_for(model) is None else None
            if limit is None:
                return
            prompt = self._floor(model, req.prompt, limit)
            if prompt + completion <= limit:
                return
            refusal = refusal or (prompt, limit)
        if refusal is not None:
            prompt, limit = refusal
            detail = (f"the prompt has at least {prompt} tokens" if prompt > limit
                      else f"you requested at least {prompt + completion} tokens ({prompt} or more in the prompt, "
                           f"{completion} for the completion)")
            raise InvalidArgument(f"This model's maximum context length is {limit} tokens, but {detail}.",
                                  reason="context_length_exceeded", param="messages")

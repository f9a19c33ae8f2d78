"""A request's prompt tokens for each model it may go to, worked out once for all its attempts
(a retry, a failover to another engine, a fallback model's picks). A long prompt's are worked
out before the pick, off the event loop, where the tokenizer can (``Tokenizer.ahead``); a short
one's when a pick first needs them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from llmesh.tool_prompt import render
from llmesh.types import Prompt, Tools
from llmesh.gateway.domain.prompt_tokens import Tokenizer


class RequestTokens:
    def __init__(self, tokenizer: Tokenizer, prompt: Prompt, tools: Tools | None = None) -> None:
        self._tokenizer, self._chat, self._tools = tokenizer, prompt, tools
        self._ids: dict[str, Sequence[int]] = {}

    @functools.cached_property
    def _prompt(self) -> Prompt:
        """The chat as an engine sees it: the offered tools in its system message (``render``)."""
        return render(self._chat, self._tools)

    async def ready(self, model: str) -> None:
        """Tokenizes the prompt for ``model`` now, on a thread, if it is long enough to be worth it."""
        if model not in self._ids and (ids := await self._tokenizer.ahead(model, self._prompt)) is not None:
            self._ids[model] = ids

    def of(self, model: str) -> Callable[[], Sequence[int]]:
        """The prompt's tokens for ``model``, when called: those ``ready`` found, else tokenized then."""
        def tokens() -> Sequence[int]:
            if model not in self._ids:
                self._ids[model] = self._tokenizer(model, self._prompt)
            return self._ids[model]
        return tokens

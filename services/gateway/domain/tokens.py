"""Counting a prompt's tokens before admission: exactly as the engine will (the
same tokenizer and chat template, through PromptTokens: a GGUF's vocabulary, the
sim's tokenizer), else an estimate of a token per 3 bytes plus 4 per message and
3 for the reply. Either way the count is reconciled with the engine's own when the
request ends."""

from __future__ import annotations

import math

from llmesh.types import Prompt, Tools
from llmesh.gateway.domain.prompt_tokens import RequestTokens, Tokenizer

PER_MESSAGE = 4
PER_REPLY = 3
_EXACT_CHARS = 1 << 16


def utf8_size(text: str) -> int:
    """A text's UTF-8 size, exact up to ``_EXACT_CHARS`` characters; past that, for text that is
    not ASCII, 3 bytes a character (CJK's size; an upper bound for every BMP character) instead
    of encoding it: encoding 16 MiB of Chinese on the event loop took ~30 ms."""
    if text.isascii():
        return len(text)
    return len(text.encode()) if len(text) <= _EXACT_CHARS else 3 * len(text)


class TokenCounter:
    def __init__(self, tokens: Tokenizer):
        self._tokens = tokens

    async def count_texts(self, model: str, texts: tuple[str, ...]) -> int:
        """An embeddings request's inputs: each as a raw text (no chat template); many short ones that
        are long together go off the event loop in one trip."""
        prompts = [Prompt(text=t) for t in texts]
        ids = await self._tokens.ahead(model, prompts)
        if ids is None:
            ids = [self._tokens(model, p) for p in prompts]
        return sum(len(i) if i else _estimate(p) for i, p in zip(ids, prompts, strict=True))

    def tokens(self, prompt: Prompt, tools: Tools | None = None) -> RequestTokens:
        """A request's tokens, to count here and to pick its engines with (the router takes them
        when the prompt and tools are still these)."""
        return RequestTokens(self._tokens, prompt, tools)

    async def count(self, model: str, tokens: RequestTokens) -> int:
        """The prompt's tokens for ``model``, with the offered tools as the engine renders them."""
        await tokens.ready(model)  # a long prompt: off the event loop
        if ids := tokens.of(model)():
            return len(ids)
        return _estimate(tokens.prompt)


def _estimate(prompt: Prompt) -> int:
    """A token per 3 bytes, 4 per message and 3 for the reply (no tokenizer for the model)."""
    texts = [m.content for m in prompt.messages] if prompt.messages is not None else [prompt.text or ""]
    n = sum(math.ceil(utf8_size(t) / 3) for t in texts)
    if prompt.messages is not None:
        n += PER_MESSAGE * len(prompt.messages) + PER_REPLY
    return n

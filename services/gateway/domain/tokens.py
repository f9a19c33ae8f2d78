"""Counting a prompt's tokens before admission: exactly as the engine will (the
same tokenizer and chat template, through PromptTokens: a GGUF's vocabulary, the
sim's tokenizer), else an estimate of a token per 3 bytes plus 4 per message and
3 for the reply. Either way the count is reconciled with the engine's own when the
request ends."""

from __future__ import annotations

import math

from llmesh.types import Prompt
from llmesh.gateway.domain.prompt_tokens import PromptTokens

PER_MESSAGE = 4
PER_REPLY = 3


class TokenCounter:
    def __init__(self, tokens: PromptTokens):
        self._tokens = tokens

    def count_texts(self, model: str, texts: tuple[str, ...]) -> int:
        """An embeddings request's inputs: each as a raw text (no chat template)."""
        return sum(self.count(model, Prompt(text=t)) for t in texts)

    def count(self, model: str, prompt: Prompt) -> int:
        ids = self._tokens(model, prompt)
        if ids:
            return len(ids)
        texts = [m.content for m in prompt.messages] if prompt.messages is not None else [prompt.text or ""]
        n = sum(math.ceil(len(t.encode()) / 3) for t in texts)
        if prompt.messages is not None:
            n += PER_MESSAGE * len(prompt.messages) + PER_REPLY
        return n

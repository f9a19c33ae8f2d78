"""The router's ports: what it calls engines and external providers through (their adapters:
``engines``, ``providers``). Its tokenizers' is ``llmesh.gateway.domain.prompt_tokens.Tokenizer``."""

from __future__ import annotations

from typing import Protocol

from opentelemetry.trace import Span

from llmesh.liveconfig.schema import Provider
from llmesh.gateway.context import CompletionRequest, Items


class EngineClient(Protocol):
    def generate(self, address: str, req: CompletionRequest, timeout_s: float, parent: Span) -> Items: ...

    def embed(self, address: str, req: CompletionRequest, timeout_s: float, parent: Span) -> Items:
        """An embeddings request's answer: one ``Vectors`` item."""
        ...

    def connected(self, address: str) -> bool:
        """Whether a call to ``address`` would go out now (asks to connect when not)."""
        ...


class ProviderPort(Protocol):
    """External OpenAI-compatible APIs (the live config's ``providers``)."""
    def generate(self, provider: Provider, remote_model: str, req: CompletionRequest, timeout_s: float) -> Items: ...

"""The contract every backend implements. The engine core does the rest
(admission, context checks, stop strings, usage)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from llmesh.types import Prompt


@dataclass(frozen=True, slots=True)
class DecodeParams:
    """What the backend itself must honour while decoding."""
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None


class Backend(Protocol):
    name: str            # "llamacpp", "sim", ...
    model: str           # the model name clients ask for
    context_length: int  # tokens of prompt + completion the backend can hold

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of the prompt as the model will see it (chat template applied)."""
        ...

    def stream(self, tokens: list[int], params: DecodeParams) -> AsyncIterator[str]:
        """Yields the text of each generated token (possibly "" while a multi-byte
        character is incomplete); ends at end-of-sequence or ``max_new_tokens``.
        Closing the iterator early must stop the decoding and free its resources."""
        ...

    async def close(self) -> None: ...

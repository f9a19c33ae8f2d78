"""Plain domain types shared by the services (no gRPC, no HTTP)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Priority(enum.IntEnum):
    """A request's class in an engine's queue: higher classes are admitted first."""
    LOW = 1
    NORMAL = 2
    HIGH = 3


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """Constrains the answer's shape: ``json_object`` (any JSON object) or
    ``json_schema`` (JSON matching ``schema``, a JSON Schema as JSON text)."""
    type: str
    schema: str | None = None


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling controls; None means the serving default. ``logprobs`` is the number
    of most likely alternatives to report per token (0: only the chosen token's);
    None asks for no log probabilities."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    response_format: ResponseFormat | None = None

    @property
    def deterministic(self) -> bool:
        """Greedy (temperature 0), or sampling with a fixed seed: the same request gets the same answer."""
        return self.temperature == 0.0 or self.seed is not None


@dataclass(frozen=True, slots=True)
class Prompt:
    """Either a chat (template applied by the engine) or raw completion text."""
    messages: tuple[Message, ...] | None = None
    text: str | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token and its log probability under the model, with the most
    likely alternatives at that position (``top``: (token, logprob), best first)."""
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    """Generated text that became final, and the number of tokens behind it; with
    ``logprobs`` requested, one entry per token behind it."""
    text: str
    tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Finish:
    """The end of a generation."""
    reason: FinishReason
    usage: Usage = field(default_factory=Usage)

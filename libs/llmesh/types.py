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
    TOOL_CALLS = "tool_calls"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the model made. Streamed, a piece of one: the first piece of a
    call has its index, id and name; later pieces with that index add to ``arguments``."""
    index: int = 0
    id: str = ""
    name: str = ""
    arguments: str = ""  # JSON text


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call; ``parameters`` is a JSON Schema as JSON text."""
    name: str
    description: str = ""
    parameters: str = ""
    strict: bool | None = None


@dataclass(frozen=True, slots=True)
class Tools:
    """The functions a request offers and whether to call them: ``choice`` is auto |
    none | required | function (then ``function`` names it); ``parallel`` None: the
    provider's default."""
    functions: tuple[Tool, ...] = ()
    choice: str = "auto"
    function: str = ""
    parallel: bool | None = None


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # assistant: the calls it made
    tool_call_id: str = ""  # tool: the call this message answers


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """Constrains the answer's shape: ``json_object`` (any JSON object) or
    ``json_schema`` (JSON matching ``schema``, a JSON Schema as JSON text)."""
    type: str
    schema: str | None = None


# Sampling's knobs beyond temperature and top_p (each also a SamplingParams field of that name).
KNOBS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


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
    # The knobs apps written for vLLM send (SamplingParams in common.proto); each has a value that
    # means "off", the same as unset: -1 or 0, 0, 1, 0, 0.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def knobs(self) -> dict[str, int | float]:
        """The knobs set to something other than off, by name: what a backend must honour."""
        on: dict[str, int | float] = {}
        if self.top_k is not None and self.top_k > 0:
            on["top_k"] = self.top_k
        for name, value, off in (("min_p", self.min_p, 0.0), ("repetition_penalty", self.repetition_penalty, 1.0),
                                 ("presence_penalty", self.presence_penalty, 0.0),
                                 ("frequency_penalty", self.frequency_penalty, 0.0)):
            if value is not None and value != off:
                on[name] = value
        return on

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
    tool_calls: tuple[ToolCall, ...] = ()  # pieces of the tool calls being made


@dataclass(frozen=True, slots=True)
class Finish:
    """The end of a generation."""
    reason: FinishReason
    usage: Usage = field(default_factory=Usage)


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    ecc_corrected: int
    ecc_uncorrected: int
    driver_version: str


@dataclass(frozen=True, slots=True)
class Hardware:
    """What an engine runs on (its report to the scheduler)."""
    cpu_model: str
    cpu_cores: int
    memory_total_bytes: int
    memory_available_bytes: int
    gpus: tuple[Gpu, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class SelfTest:
    """An engine's last self-test (one greedy token): ``checked_unix`` 0 when not run yet."""
    ok: bool = False
    detail: str = ""  # why it failed; empty when ok
    checked_unix: float = 0.0
    latency_ms: float = 0.0

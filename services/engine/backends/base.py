"""The contract every backend implements. The engine core does the rest
(admission, context checks, stop strings, usage)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import Protocol, TypeGuard

from llmesh.errors import InvalidArgument
from llmesh.kvhash import HashScheme
from llmesh.types import KNOBS, Delta, FinishReason, Priority, Prompt, ResponseFormat, TokenLogprob, Tools
from llmesh.engine.kvblocks import KvEvent


class KvEventSource(Protocol):
    @property
    def scheme(self) -> HashScheme | None:
        """How the hashes in its events are computed; None: unknown."""
    def take_events(self) -> list[KvEvent]: ...
    def resync(self) -> list[KvEvent]: ...


@dataclass(frozen=True, slots=True)
class DecodeParams:
    """What the backend itself must honour while decoding."""
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    adapter: str | None = None  # a LoRA adapter the backend has loaded, by name
    priority: Priority = Priority.NORMAL  # a backend that queues internally serves higher classes first
    logprobs: int | None = None  # set: report log probabilities with this many alternatives
    response_format: ResponseFormat | None = None  # set: constrain decoding to this shape
    # set: the tools offered (tool_choice auto, required or a named function): decoding is constrained
    # so that every call parses and matches its function's schema (the backend's call_reader reads
    # them), the prompt already shows them (the backend's tokenize_chat)
    tools: Tools | None = None
    continued_tokens: int = 0  # the prompt's last N tokens are answer text produced elsewhere
    # The knobs (Capabilities.knobs), each at its "off" value unless the request set it: top_k 0
    # (else 1..vocab_size), min_p 0, repetition_penalty 1 (over the prompt's and the answer's
    # tokens), presence_penalty and frequency_penalty 0 (over the answer's tokens, continued ones too).
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def continues(self) -> bool:
        return self.continued_tokens > 0


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do beyond plain sampling, as it declares it (``Backend.capabilities``;
    the engine never probes for methods): the core refuses a request that needs a missing
    one, and calls the optional methods below only on a backend that declares them."""
    logprobs: bool = False          # reports log probabilities (``Token`` pieces)
    response_format: bool = False   # constrains decoding to a JSON shape
    continuation: bool = False      # has ``tokenize_continuation(text) -> list[int]``
    steps: bool = False             # has ``stream_steps``: every piece a decode step made, in one list
    adapters: bool = False          # has ``load_adapter(name, path)`` and ``unload_adapter(name)`` (LoRA)
    knobs: frozenset[str] = frozenset()  # the sampling knobs it honours (Sampling.knobs' names)
    generates: bool = True          # answers Generate (False: an embedding-only backend, which refuses it)
    embeddings: bool = False        # has ``tokenize_inputs``, ``embed`` and ``max_input_tokens`` (Embed)
    tools: bool = False             # honours DecodeParams.tools (a call always parses and matches its schema):
                                    # has ``tokenize_chat(prompt, tools)`` and ``call_reader(tools, stops)``


ALL_KNOBS = frozenset(KNOBS)  # llama.cpp's samplers and vLLM's SamplingParams have every one


def steps_of(backend: Backend, tokens: list[int], params: DecodeParams) -> AsyncGenerator[list[Piece], None]:
    """The backend's pieces grouped as they become ready: its own ``stream_steps``
    (every piece a decode step produced, or a backlog, in one list) where it declares
    them, else one piece a list. The engine sends each group as one message."""
    if has_steps(backend):
        return backend.stream_steps(tokens, params)
    return _one_by_one(backend.stream(tokens, params))


async def _one_by_one(pieces: AsyncGenerator[Piece, None]) -> AsyncGenerator[list[Piece], None]:
    try:
        async for piece in pieces:
            yield [piece]
    finally:
        await pieces.aclose()


@dataclass(frozen=True, slots=True)
class Token:
    """A generated token's text with its log probabilities (backends that report them)."""
    text: str
    logprob: TokenLogprob


Piece = str | Token  # what a backend yields for a token: its text, or a Token when logprobs were asked for


class Backend(Protocol):
    name: str            # "llamacpp", "sim", ...
    model: str           # the model name clients ask for
    context_length: int  # tokens of prompt + completion the backend can hold
    vocab_size: int      # valid token ids are 0 .. vocab_size - 1
    capabilities: Capabilities  # what it does beyond plain sampling, and which optional methods it has
    gpu_memory_share: float  # of the GPU's memory it reserves while loaded (vLLM); 0 for none

    @property
    def models(self) -> tuple[str, ...]:
        """What requests may name: the model, then any LoRA adapters."""

    @property
    def kv_blocks(self) -> KvEventSource:
        """KV block events for the scheduler."""

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of the prompt as the model will see it (chat template applied)."""
        ...

    def stream(self, tokens: list[int], params: DecodeParams) -> AsyncGenerator[Piece, None]:
        """Yields the text of each generated token (possibly "" while a multi-byte
        character is incomplete), or a ``Token`` when ``params.logprobs`` is set; ends at end-of-sequence or
        ``max_new_tokens``.
        Closing the iterator early must stop the decoding and free its resources."""
        ...

    def kv_usage(self) -> float:
        """Share of the KV cache that running sequences hold (0..1)."""
        ...

    def prefix_cache_stats(self) -> tuple[int, int]:
        """Since start: prompt tokens looked up in the prefix cache, and those found."""
        ...

    async def close(self) -> None: ...


# The optional methods, each behind its capability: narrow a Backend with has_steps, can_continue,
# calls_tools or has_adapters before calling one.
class SteppingBackend(Backend, Protocol):
    def stream_steps(self, tokens: list[int], params: DecodeParams) -> AsyncGenerator[list[Piece], None]: ...


class ContinuingBackend(Backend, Protocol):
    def tokenize_continuation(self, text: str) -> list[int]: ...


class EmbeddingBackend(Backend, Protocol):
    max_input_tokens: int  # an input over this many tokens is refused (never truncated)

    def tokenize_inputs(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids as ``embed`` takes them (not truncated)."""
        ...

    def embed(self, token_ids: list[list[int]]) -> list[list[float]] | Awaitable[list[list[float]]]:
        """One vector per input (each within ``max_input_tokens``), in order. A coroutine
        function (``async def``: vLLM's engine) the engine awaits; else CPU work, which the
        engine calls in a thread."""
        ...


class EmbeddingOnly:
    """The generative half of ``Backend`` for an embedding-only backend
    (``Capabilities(generates=False, embeddings=True)``, whose Generate the core refuses before
    it gets here): a prompt's tokens are its text's as ``tokenize_inputs`` gives them, no text is
    generated, and there is no KV cache to report."""

    model: str

    def tokenize_inputs(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            raise InvalidArgument(f"The model '{self.model}' is an embedding model: it takes texts, not messages.",
                                  param="messages")
        return self.tokenize_inputs([prompt.text or ""])[0]

    async def stream(self, tokens: list[int], params: DecodeParams) -> AsyncGenerator[Piece, None]:
        raise InvalidArgument(f"The model '{self.model}' is an embedding model: it generates no text.",
                              reason="model_not_generative")
        yield ""  # pragma: no cover - makes this an async generator

    def kv_usage(self) -> float:
        return 0.0

    def prefix_cache_stats(self) -> tuple[int, int]:
        return 0, 0


class CallReading(Protocol):
    """One answer's Deltas turned into text and ToolCalls (``llmesh.engine.toolcalls.CallReader``'s shape)."""
    calls: int

    @property
    def stopped(self) -> bool: ...
    def feed(self, delta: Delta) -> Delta | None: ...
    def flush(self) -> Delta | None: ...
    def reason(self, reason: FinishReason) -> FinishReason: ...


class ToolBackend(Backend, Protocol):
    def tokenize_chat(self, prompt: Prompt, tools: Tools | None) -> list[int]:
        """The chat's tokens with the offered tools (``llmesh.tool_prompt.offered``) shown and the
        history's calls and tool results rendered as this backend's calls are read."""
        ...

    def call_reader(self, tools: Tools, stops: tuple[str, ...]) -> CallReading:
        """A reader for one answer to a request offering ``tools``, with the request's stop strings
        (applied to text only, never inside a call)."""
        ...


class AdapterBackend(Backend, Protocol):
    async def load_adapter(self, name: str, path: str) -> None: ...
    async def unload_adapter(self, name: str) -> None: ...


def has_steps(backend: Backend) -> TypeGuard[SteppingBackend]:
    return backend.capabilities.steps


def can_continue(backend: Backend) -> TypeGuard[ContinuingBackend]:
    return backend.capabilities.continuation


def can_embed(backend: Backend) -> TypeGuard[EmbeddingBackend]:
    return backend.capabilities.embeddings


def calls_tools(backend: Backend) -> TypeGuard[ToolBackend]:
    return backend.capabilities.tools


def has_adapters(backend: Backend) -> TypeGuard[AdapterBackend]:
    return backend.capabilities.adapters

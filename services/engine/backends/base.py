"""The contract every backend implements. The engine core does the rest
(admission, context checks, stop strings, usage)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from llmesh.kvhash import HashScheme
from llmesh.types import Priority, Prompt, ResponseFormat, TokenLogprob
from llmesh.engine.kvblocks import KvEvent


class KvEventSource(Protocol):
    scheme: HashScheme | None  # how the hashes in its events are computed; None: unknown
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
    continued_tokens: int = 0  # the prompt's last N tokens are answer text produced elsewhere

    @property
    def continues(self) -> bool:
        return self.continued_tokens > 0


# What a backend may support beyond plain sampling; it names them in ``features``
# and the core refuses requests that need a missing one.
LOGPROBS = "logprobs"
RESPONSE_FORMAT = "response_format"
CONTINUATION = "continuation"  # the backend has ``tokenize_continuation(text) -> list[int]``


def steps_of(backend: Backend, tokens: list[int], params: DecodeParams) -> AsyncIterator[list]:
    """The backend's pieces grouped as they become ready: its own ``stream_steps``
    (every piece a decode step produced, or a backlog, in one list) where it has
    one, else one piece a list. The engine sends each group as one message."""
    if _steps_are_current(type(backend)):
        return backend.stream_steps(tokens, params)
    return _one_by_one(backend.stream(tokens, params))


@functools.lru_cache(maxsize=64)  # asked on every request, of a handful of backend classes
def _steps_are_current(cls: type) -> bool:
    """Whether ``stream_steps`` is defined, and not older than ``stream``: a subclass that
    overrides ``stream`` alone (a test's backend) is streamed through its own ``stream``."""
    owner = lambda name: next((c for c in cls.__mro__ if name in vars(c)), None)  # noqa: E731
    steps, stream = owner("stream_steps"), owner("stream")
    return steps is not None and (stream is None or issubclass(steps, stream))


async def _one_by_one(pieces: AsyncIterator) -> AsyncIterator[list]:
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


class Backend(Protocol):
    name: str            # "llamacpp", "sim", ...
    model: str           # the model name clients ask for
    context_length: int  # tokens of prompt + completion the backend can hold
    vocab_size: int      # valid token ids are 0 .. vocab_size - 1
    models: tuple[str, ...]  # what requests may name: the model, then any LoRA adapters
    kv_blocks: KvEventSource  # KV block events for the scheduler
    features: frozenset[str]  # LOGPROBS, RESPONSE_FORMAT, CONTINUATION; a backend without the attribute has none

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of the prompt as the model will see it (chat template applied)."""
        ...

    def stream(self, tokens: list[int], params: DecodeParams) -> AsyncIterator[str]:
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

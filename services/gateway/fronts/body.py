"""An HTTP request body into the values the pipeline needs (``Parsed``): a small body inline, a
large one off the event loop, with the same answer either way (the same values, the same error
with the same message).

Parsing a body is one C call that holds the GIL from start to end: pydantic's JSON validation
took 18-22 ms for 16 MiB of plain text here, 37 ms for Chinese text and 64-110 ms for text made of
escapes (``\\"``, ``\\u0000``). A thread would not help: a ticker thread saw the whole call as one
stall of the same length. So a body over ``threshold`` bytes is parsed in the gateway's worker
processes (``GuardWorkers.call``), at most ``concurrency`` bodies at a time (the others wait for
a turn: the gateway already holds their bytes, nothing more is spent on them meanwhile). What
comes back is plain domain values: unpickling a 16 MiB text is one GIL hold of ~3 ms (ASCII) to
~30 ms (all Chinese, decoded from UTF-8), in the pool's own thread. Without workers, or when a
worker died under the parse, the body is parsed inline as before."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from llmesh.errors import Unavailable
from llmesh.types import Prompt, Sampling, Tools
from llmesh.gateway.fronts.openai_api import Body, parse

log = logging.getLogger("llmesh.gateway.http")
OFFLOAD_BYTES = 256 * 1024  # pydantic parses ~0.5 ms of it; a worker's round trip costs ~1 ms
_LARGE_BODY = 1 << 20  # an inline parse this large is one long step: others go before the next


@dataclass(frozen=True, slots=True)
class Parsed:
    """A request body's values, as the pipeline takes them."""
    model: str
    prompt: Prompt
    sampling: Sampling
    n: int
    tools: Tools | None
    user: str | None
    stream: bool
    include_usage: bool


def read(body_cls: type[Body], raw: bytes | bytearray) -> Parsed:
    """The body's values, checked in the order the front always checked them (JSON and types,
    the prompt, the sampling parameters, ``n``): the first error found is the one raised. Plain
    values in, plain values out, so it runs in a worker process as well."""
    body = parse(body_cls, raw)
    prompt = body.prompt_value()
    sampling = body.sampling_params()
    n = body.choices
    return Parsed(body.model, prompt, sampling, n, body.tools_value(), body.user, bool(body.stream),
                  body.include_usage)


Reader = Callable[[type[Body], bytes], Parsed]
Offload = Callable[..., Awaitable[Any]]  # GuardWorkers.call: (reader, body class, raw) -> the reader's answer
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class BodyReader:
    """``await reader.read(body_cls, raw)``: ``read``'s answer; over ``threshold`` bytes through
    ``offload`` (no offload: always inline)."""

    def __init__(self, offload: Offload | None = None, threshold: int = OFFLOAD_BYTES, concurrency: int = 2):
        self._offload = offload
        self._threshold = threshold
        self._turns = asyncio.Semaphore(max(1, concurrency))

    async def read(self, body_cls: type[Body], raw: bytes | bytearray) -> Parsed:
        return await self.parse(read, body_cls, raw)

    async def parse(self, reader: Callable[[type[M], bytes | bytearray], T], body_cls: type[M],
                    raw: bytes | bytearray) -> T:
        """``reader(body_cls, raw)`` (a module-level function: it goes to a worker by name), the
        same way: the embeddings body's reader too."""
        if self._offload is not None and len(raw) > self._threshold:
            async with self._turns:
                try:
                    answer: T = await self._offload(reader, body_cls, raw)
                    return answer
                except Unavailable:  # the worker died under it (logged there): the old way, once
                    log.warning("a large body parsed on the event loop", extra={"bytes": len(raw)})
        parsed = reader(body_cls, raw)
        if len(raw) > _LARGE_BODY:
            await asyncio.sleep(0)
        return parsed

"""The batch lines' work queue. ``take`` hands out lines; ``ack`` says a line's result is
recorded. On one machine ``LocalQueue`` (in process: a gateway restarted mid-batch takes
its open batches up again from their input files, ``BatchService.resume``); with Redis
``queue_redis.StreamQueue`` (a consumer group: several gateway workers share a batch, and
a dead worker's lines are claimed by another)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from llmesh.gateway.domain.batches.lines import Line


@dataclass(frozen=True, slots=True)
class Work:
    batch_id: str
    index: int
    custom_id: str
    body: bytes
    token: str = ""  # the queue's own name for the entry (a stream entry id)


class WorkQueue(Protocol):
    async def push(self, batch_id: str, lines: Sequence[Line]) -> None: ...
    async def take(self, n: int, wait_s: float) -> list[Work]: ...
    async def ack(self, work: Work) -> None: ...
    async def close(self) -> None: ...


class LocalQueue:
    def __init__(self) -> None:
        self._items: deque[Work] = deque()
        self._ready = asyncio.Event()

    async def push(self, batch_id: str, lines: Sequence[Line]) -> None:
        self._items.extend(Work(batch_id, line.index, line.custom_id, line.body) for line in lines)
        self._ready.set()

    async def take(self, n: int, wait_s: float) -> list[Work]:
        if not self._items:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), wait_s)
            except TimeoutError:
                return []
        return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    async def ack(self, work: Work) -> None:
        return None

    async def close(self) -> None:
        return None

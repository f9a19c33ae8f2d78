"""Admission to a fixed number of running slots with a bounded wait queue (FIFO).

A full queue fails fast with Overloaded; a caller cancelled while waiting leaves
the queue; a slot is handed straight to the next waiter when one is released."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from llmesh.errors import Overloaded


class Admission:
    def __init__(self, max_running: int, max_waiting: int, on_change: Callable[[], None] = lambda: None):
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._on_change = on_change

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self._running < self.max_running and not self._waiters:
            self._running += 1
            self._on_change()
            return
        if len(self._waiters) >= self.max_waiting:
            raise Overloaded(f"The engine is busy: {self._running} running and "
                             f"{len(self._waiters)} waiting (limit {self.max_waiting}).")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._on_change()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # the slot was handed to us just as we were cancelled
            elif fut in self._waiters:
                self._waiters.remove(fut)
                self._on_change()
            raise

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes on; running stays the same
                self._on_change()
                return
        self._running -= 1
        self._on_change()

"""Admission to a fixed number of running slots with a bounded wait queue, in
priority classes.

Waiters are served highest class first, first come first served within a class. A
full queue fails a newcomer fast with Overloaded, unless a lower class than the
newcomer's is waiting: then that class's newest waiter is shed (it fails with
Overloaded, reason "shed") and the newcomer takes its place. A caller cancelled
while waiting leaves the queue; a slot is handed straight to the next waiter when
one is released."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from llmesh.errors import Overloaded
from llmesh.types import Priority

_HIGH_FIRST = sorted(Priority, reverse=True)
_LOW_FIRST = sorted(Priority)


class Admission:
    def __init__(self, max_running: int, max_waiting: int, on_change: Callable[[], None] = lambda: None,
                 on_refuse: Callable[[Priority, str], None] = lambda priority, why: None):
        """``on_refuse(priority, why)`` is told of every request turned away: ``why`` is
        "queue_full" (refused on arrival) or "shed" (removed from the queue)."""
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._running = 0
        self._queues: dict[Priority, deque[asyncio.Future[None]]] = {p: deque() for p in _HIGH_FIRST}
        self._on_change = on_change
        self._on_refuse = on_refuse

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def waiting_in(self, priority: Priority) -> int:
        return len(self._queues[priority])

    @asynccontextmanager
    async def slot(self, priority: Priority = Priority.NORMAL) -> AsyncIterator[None]:
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, priority: Priority) -> None:
        waiting = self.waiting
        if self._running < self.max_running and not waiting:
            self._running += 1
            self._on_change()
            return
        if waiting >= self.max_waiting and not self._make_room(priority):
            self._on_refuse(priority, "queue_full")
            raise Overloaded(f"The engine is busy: {self._running} running and "
                             f"{waiting} waiting (limit {self.max_waiting}).")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues[priority]
        queue.append(fut)
        self._on_change()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release()  # the slot was handed to us just as we were cancelled
            elif fut in queue:
                queue.remove(fut)
                self._on_change()
            raise

    def _make_room(self, priority: Priority) -> bool:
        """Frees a place in the full queue for a newcomer of ``priority`` by shedding the
        newest waiter of the lowest class below it; False if no lower class waits."""
        for lower in _LOW_FIRST:
            if lower >= priority:
                return False
            queue = self._queues[lower]
            if not queue:
                continue
            victim = queue.pop()
            if not victim.done():  # a cancelled waiter not yet gone frees its place without a victim
                victim.set_exception(Overloaded(
                    "The engine's queue is full and this request was shed for one of a higher priority.",
                    reason="shed"))
                self._on_refuse(lower, "shed")
            return True
        return False

    def _release(self) -> None:
        for queue in self._queues.values():  # highest class first
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)  # the slot passes on; running stays the same
                    self._on_change()
                    return
        self._running -= 1
        self._on_change()

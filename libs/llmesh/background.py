"""Work a request starts but need not wait for (cache stores, bookkeeping): kept
referenced until done, and awaited as a whole on shutdown; and a guard for loops whose
cancellation a library may swallow."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

log = logging.getLogger("llmesh.service")

CANCEL_WAIT_S = 5.0  # a cancelled loop ends at its next await; its Redis calls are bounded by a second


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        while self._tasks:  # a finishing task may start another
            await asyncio.gather(*self._tasks, return_exceptions=True)


def honour_cancel() -> None:
    """Raises CancelledError if the current task is being cancelled. Call it after each Redis call
    in a loop that must stop when cancelled: redis-py (8.1) can swallow a cancellation (a
    pipeline's ``execute`` was seen returning normally while its task was being cancelled), and
    a loop over it then never stops (a gateway worker that never exited; a test's cleanup that
    hung)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_all(tasks: Iterable[asyncio.Task[Any]], timeout_s: float = CANCEL_WAIT_S) -> None:
    """Cancels ``tasks`` and waits up to ``timeout_s`` for them to end: one that a library kept from
    ending is logged by name and left, so that the rest of a stop (the audit's close among it) runs."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    if pending:
        log.error("tasks still running after their cancel; stopping without them",
                  extra={"tasks": sorted(t.get_name() for t in pending), "waited_s": timeout_s})

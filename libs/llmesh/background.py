"""Work a request starts but need not wait for (cache stores, bookkeeping): kept
referenced until done, and awaited as a whole on shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


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

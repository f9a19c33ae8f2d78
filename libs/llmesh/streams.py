"""Stream helpers for token streams."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from llmesh.types import Delta, Finish


async def coalesce(source: AsyncIterator[Delta | Finish]) -> AsyncIterator[Delta | Finish]:
    """Passes items through one by one while the consumer keeps up; when it falls
    behind, the deltas that piled up go out as one (text joined, tokens summed).
    Under load this turns N small messages into one, which is where a streaming
    proxy's CPU goes. Closing the result closes the source."""
    pending: deque[Delta | Finish | BaseException] = deque()
    ready = asyncio.Event()
    finished = False

    async def pump() -> None:
        nonlocal finished
        try:
            async for item in source:
                pending.append(item)
                ready.set()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer below
            pending.append(exc)
        finally:
            finished = True
            ready.set()

    task = asyncio.create_task(pump())
    try:
        while True:
            await ready.wait()
            ready.clear()
            while pending:
                item = pending.popleft()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Delta) and pending and isinstance(pending[0], Delta):
                    texts, tokens = [item.text], item.tokens
                    while pending and isinstance(pending[0], Delta):
                        nxt = pending.popleft()
                        texts.append(nxt.text)
                        tokens += nxt.tokens
                    item = Delta(text="".join(texts), tokens=tokens)
                yield item
            if finished and not pending:
                return
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()

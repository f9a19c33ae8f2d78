"""``n`` > 1: one pipeline run per choice, side by side, merged into one stream of
(choice index, item). Each run is a full request (limits count it, the cache may
answer it); with a seed, choice i samples with seed + i so the choices differ."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing, suppress
from dataclasses import replace

from llmesh.errors import LlmeshError
from llmesh.types import Delta, Finish, Usage
from llmesh.gateway.context import CompletionRequest, Items

ChoiceItems = AsyncGenerator[tuple[int, Delta | Finish], None]  # (choice index, item)


def choice_requests(req: CompletionRequest, n: int) -> list[CompletionRequest]:
    if n == 1:
        return [req]
    out = []
    for i in range(n):
        sampling = req.sampling if req.sampling.seed is None else replace(req.sampling, seed=req.sampling.seed + i)
        out.append(replace(req, request_id=f"{req.request_id}-{i}", sampling=sampling))
    return out


async def merge(streams: list[Items]) -> ChoiceItems:
    """Items of every stream as they come, tagged with the stream's index. The first
    failure ends the merge (the other runs are cancelled) and is raised."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Delta | Finish | LlmeshError | None]] = asyncio.Queue()  # None: i ended

    async def pump(i: int, stream: Items) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put((i, item))
            await queue.put((i, None))
        except LlmeshError as exc:
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, got = await queue.get()
            if got is None:
                running -= 1
            elif isinstance(got, LlmeshError):
                raise got
            else:
                yield i, got
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task


class UsageSum:
    """The response's usage over its choices: the prompt once, every choice's completion."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, finish: Finish) -> None:
        self.prompt_tokens = max(self.prompt_tokens, finish.usage.prompt_tokens)
        self.completion_tokens += finish.usage.completion_tokens

    @property
    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens)

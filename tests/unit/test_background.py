"""llmesh.background's guards for stops: ``honour_cancel`` raises in a task being cancelled even
after a call swallowed the CancelledError; ``cancel_all`` waits a bounded time and names a task
that would not end, so the rest of a stop runs."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from llmesh.background import cancel_all, honour_cancel


async def swallows_then_honours(calls: list[str]) -> None:
    while True:
        try:
            await asyncio.sleep(10)  # a library call that eats its cancellation
        except asyncio.CancelledError:
            calls.append("swallowed")
        honour_cancel()


async def test_honour_cancel_raises_after_a_swallowed_cancellation():
    calls: list[str] = []
    task = asyncio.create_task(swallows_then_honours(calls))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert calls == ["swallowed"]


async def test_honour_cancel_does_nothing_in_a_task_not_being_cancelled():
    honour_cancel()  # the test's own task: nothing to raise
    assert not asyncio.current_task().cancelling()


async def test_cancel_all_names_a_task_that_will_not_end_and_returns_in_time(caplog):
    stuck = asyncio.Event()

    async def never_ends() -> None:
        while not stuck.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass  # swallowed every time, as no task should

    tasks = [asyncio.create_task(never_ends(), name="stubborn"), asyncio.create_task(asyncio.sleep(10), name="polite")]
    await asyncio.sleep(0)
    began = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="llmesh.service"):
        await cancel_all(tasks, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - began < 2
    assert tasks[1].cancelled() and not tasks[0].done()
    [record] = [r for r in caplog.records if r.name == "llmesh.service"]
    assert record.tasks == ["stubborn"]
    stuck.set()
    tasks[0].cancel()
    await asyncio.wait(tasks[:1], timeout=2)
    assert tasks[0].done()


async def test_cancel_all_of_nothing_returns_at_once():
    began = time.monotonic()
    await cancel_all([], timeout_s=5)
    assert time.monotonic() - began < 0.5

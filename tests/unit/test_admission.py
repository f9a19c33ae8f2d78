import asyncio

import pytest

from llmesh.errors import Overloaded
from llmesh.engine.admission import Admission


async def test_runs_up_to_max_then_queues_then_rejects():
    adm = Admission(max_running=1, max_waiting=1)
    entered = asyncio.Event()
    release = asyncio.Event()

    async def hold():
        async with adm.slot():
            entered.set()
            await release.wait()

    first = asyncio.create_task(hold())
    await entered.wait()
    second = asyncio.create_task(hold())
    await asyncio.sleep(0)
    assert (adm.running, adm.waiting) == (1, 1)
    with pytest.raises(Overloaded) as info:
        async with adm.slot():
            pass
    assert "1 running and 1 waiting" in info.value.message
    release.set()
    await asyncio.gather(first, second)
    assert (adm.running, adm.waiting) == (0, 0)


async def test_cancelled_waiter_leaves_the_queue():
    adm = Admission(max_running=1, max_waiting=4)
    release = asyncio.Event()

    async def hold():
        async with adm.slot():
            await release.wait()

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiter = asyncio.create_task(hold())
    await asyncio.sleep(0)
    assert adm.waiting == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.waiting == 0
    release.set()
    await holder
    assert adm.running == 0


async def test_slot_passes_to_waiters_in_order():
    adm = Admission(max_running=1, max_waiting=8)
    order: list[int] = []

    async def job(i: int):
        async with adm.slot():
            order.append(i)
            await asyncio.sleep(0)

    await asyncio.gather(*(job(i) for i in range(5)))
    assert order == [0, 1, 2, 3, 4]
    assert adm.running == 0


async def test_on_change_is_called_for_every_transition():
    calls = []
    adm = Admission(1, 1, on_change=lambda: calls.append((adm.running, adm.waiting)))
    async with adm.slot():
        pass
    assert calls == [(1, 0), (0, 0)]

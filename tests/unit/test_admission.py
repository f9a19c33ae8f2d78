import asyncio

import pytest
from prometheus_client import CollectorRegistry

from llmesh.errors import Overloaded
from llmesh.types import Priority
from llmesh.engine.admission import Admission
from llmesh.engine.metrics import EngineMetrics


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


# -- priority classes -------------------------------------------------------------------

async def _hold_first(adm: Admission) -> tuple[asyncio.Task, asyncio.Event]:
    """Occupies the only running slot until the returned event is set."""
    release = asyncio.Event()
    entered = asyncio.Event()

    async def hold():
        async with adm.slot():
            entered.set()
            await release.wait()

    task = asyncio.create_task(hold())
    await entered.wait()
    return task, release


async def _queue(adm: Admission, name: str, priority: Priority, order: list[str]) -> asyncio.Task:
    async def job():
        async with adm.slot(priority):
            order.append(name)
            await asyncio.sleep(0)

    task = asyncio.create_task(job(), name=name)
    await asyncio.sleep(0)  # it reaches the queue before the next one is created
    return task


async def test_higher_classes_are_served_first_and_fifo_within_a_class():
    adm = Admission(max_running=1, max_waiting=8)
    holder, release = await _hold_first(adm)
    order: list[str] = []
    arrivals = [("low1", Priority.LOW), ("normal1", Priority.NORMAL), ("low2", Priority.LOW),
                ("high1", Priority.HIGH), ("normal2", Priority.NORMAL), ("high2", Priority.HIGH)]
    tasks = [await _queue(adm, name, p, order) for name, p in arrivals]
    assert adm.waiting == 6
    assert [adm.waiting_in(p) for p in Priority] == [2, 2, 2]
    release.set()
    await asyncio.gather(holder, *tasks)
    assert order == ["high1", "high2", "normal1", "normal2", "low1", "low2"]
    assert (adm.running, adm.waiting) == (0, 0)


async def test_a_full_queue_sheds_the_newest_waiter_of_the_lowest_class():
    refused: list[tuple[Priority, str]] = []
    adm = Admission(max_running=1, max_waiting=3, on_refuse=lambda p, why: refused.append((p, why)))
    holder, release = await _hold_first(adm)
    order: list[str] = []
    low1 = await _queue(adm, "low1", Priority.LOW, order)
    low2 = await _queue(adm, "low2", Priority.LOW, order)
    normal1 = await _queue(adm, "normal1", Priority.NORMAL, order)
    assert adm.waiting == 3

    high1 = await _queue(adm, "high1", Priority.HIGH, order)  # sheds low2, the newest low waiter
    with pytest.raises(Overloaded) as info:
        await low2
    assert info.value.reason == "shed"
    assert (adm.waiting, adm.waiting_in(Priority.LOW)) == (3, 1)
    normal2 = await _queue(adm, "normal2", Priority.NORMAL, order)  # sheds low1: a lower class still waits
    with pytest.raises(Overloaded):
        await low1
    assert [adm.waiting_in(p) for p in Priority] == [0, 2, 1]

    # Nothing below NORMAL waits now: a NORMAL or LOW newcomer is refused, not a waiter shed.
    for p in (Priority.LOW, Priority.NORMAL):
        with pytest.raises(Overloaded) as info:
            async with adm.slot(p):
                pass
        assert info.value.reason == "overloaded"
    assert refused == [(Priority.LOW, "shed"), (Priority.LOW, "shed"),
                       (Priority.LOW, "queue_full"), (Priority.NORMAL, "queue_full")]

    release.set()
    await asyncio.gather(holder, high1, normal1, normal2)
    assert order == ["high1", "normal1", "normal2"]
    assert (adm.running, adm.waiting) == (0, 0)


async def test_a_waiter_cancelled_while_shed_leaves_counts_straight():
    adm = Admission(max_running=1, max_waiting=1)
    holder, release = await _hold_first(adm)
    order: list[str] = []
    low = await _queue(adm, "low", Priority.LOW, order)
    high = await _queue(adm, "high", Priority.HIGH, order)  # high has shed low; low has not run since
    low.cancel()
    with pytest.raises(asyncio.CancelledError):
        await low
    release.set()
    await asyncio.gather(holder, high)
    assert order == ["high"]
    assert (adm.running, adm.waiting) == (0, 0)


async def test_a_slot_handed_to_a_cancelled_waiter_passes_to_the_next_class():
    adm = Admission(max_running=1, max_waiting=4)
    holder, release = await _hold_first(adm)
    order: list[str] = []
    low = await _queue(adm, "low", Priority.LOW, order)
    high = await _queue(adm, "high", Priority.HIGH, order)
    release.set()
    await asyncio.sleep(0)  # the holder leaves and hands its slot to high ...
    high.cancel()  # ... which is cancelled before it could use it
    await holder
    with pytest.raises(asyncio.CancelledError):
        await high
    await low
    assert order == ["low"]
    assert (adm.running, adm.waiting) == (0, 0)


async def test_refusals_are_counted_per_class_and_reason():
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m")
    adm = Admission(max_running=1, max_waiting=1, on_refuse=metrics.refused)
    holder, release = await _hold_first(adm)
    order: list[str] = []
    low = await _queue(adm, "low", Priority.LOW, order)
    high = await _queue(adm, "high", Priority.HIGH, order)
    with pytest.raises(Overloaded):
        await low
    with pytest.raises(Overloaded):
        async with adm.slot(Priority.HIGH):
            pass
    release.set()
    await asyncio.gather(holder, high)

    def count(priority: str, reason: str):
        return registry.get_sample_value("llmesh_engine_refused_requests_total",
                                         {"model_name": "m", "priority": priority, "reason": reason})

    assert count("low", "shed") == 1
    assert count("high", "queue_full") == 1
    assert count("high", "shed") is None and count("low", "queue_full") is None

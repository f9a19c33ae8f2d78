"""Flow control shared by two gateway workers through a real redis-server
(services/gateway/stages/flow_shared.py): two SharedFlowControllers over the same engines' slots
serve one fair order spanning both and share one queue depth and one throughput (a request that
cannot be served by its deadline is refused at once); a worker that dies (its loop and
heartbeat stop) loses its queued entries and its slots; while Redis does not answer, requests
queue in the worker and the fallback is counted."""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import pytest
import redis.asyncio
import redis.exceptions

from llmesh.errors import FlowRefused
from llmesh.liveconfig.schema import FlowClass, FlowControl, MeshConfig
from llmesh.testing import RedisServer, free_ports, wait_until_async
from llmesh.gateway.domain.fairness import Entry
from llmesh.gateway.domain.fairness_redis import SharedQueue
from llmesh.gateway.stages.flow import FlowController
from llmesh.gateway.stages.flow_shared import SharedFlowController

_models = itertools.count()
ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class Slots:
    """The engines as every worker's picker sees them."""

    def __init__(self, total: int):
        self.total, self.used = total, 0

    def capacity(self, model: str, embed: bool, engine_queue: int) -> tuple[int, int, int]:
        return self.total - self.used, self.total, 0


@pytest.fixture
async def client(redis_server):
    c = redis.asyncio.from_url(redis_server.url)
    yield c
    await c.aclose()


def worker(client, slots: Slots, ttl_ms: int = 5000, retry_s: float = 60.0,
           **flow) -> tuple[SharedFlowController, list[int]]:
    cfg = MeshConfig(flow_control=FlowControl(enabled=True, **flow))
    fallbacks: list[int] = []
    local = FlowController(lambda: cfg, slots.capacity)
    shared = SharedFlowController(client, local, lambda: cfg, slots.capacity, local._metrics, errors=ERRORS,
                                  ttl_ms=ttl_ms, retry_s=retry_s, on_fallback=lambda: fallbacks.append(1))
    return shared, fallbacks


async def stop(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def entry(tenant: str, cost: float = 100.0, klass: int = 1) -> Entry:
    return Entry(tenant=tenant, klass=klass, cost=cost, arrived=0.0, deadline=1e12, weight=1.0)


async def serve(flow: SharedFlowController, model: str, slots: Slots, tenant: str,
                served: list[tuple[str, asyncio.Event]], klass: int = 1) -> None:
    """One request: waits for its slot, takes it (in ``served``, with the gate that ends it)."""
    e, gate = entry(tenant, klass=klass), asyncio.Event()
    assert await flow.acquire(model, e, False)
    served.append((tenant, gate))
    slots.used += 1
    try:
        await gate.wait()
    finally:
        slots.used -= 1
        flow.done(model, e)


async def one_at_a_time(served: list[tuple[str, asyncio.Event]], n: int) -> list[str]:
    """Ends each served request in turn and waits for the next to hold the slot."""
    for i in range(n):
        for _ in range(200):
            if len(served) > i:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"nothing was released after {[t for t, _ in served]}")
        served[i][1].set()
    return [t for t, _ in served]


async def test_one_fair_order_spans_two_workers_and_one_queue_depth(client):
    model, slots = f"flow-shared-{next(_models)}", Slots(1)
    (a, _), (b, _) = worker(client, slots), worker(client, slots)
    loops = [asyncio.create_task(w.run()) for w in (a, b)]
    served: list[tuple[str, asyncio.Event]] = []
    tasks = [asyncio.create_task(serve(a, model, slots, "first", served))]
    await asyncio.sleep(0.2)
    for _ in range(6):  # the flood arrives at worker a, then one light request at worker b
        tasks.append(asyncio.create_task(serve(a, model, slots, "heavy", served)))
        await asyncio.sleep(0.02)
    tasks.append(asyncio.create_task(serve(b, model, slots, "light", served)))
    await asyncio.sleep(0.3)
    assert await SharedQueue(client, model, "probe").counts() == (7, 1)  # one depth over both workers
    assert a.load(model) == b.load(model) == 8.0  # each sees the other's waiting requests
    order = await one_at_a_time(served, 8)
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert order[0] == "first" and order.index("light") == 2  # behind one heavy, not six
    assert await SharedQueue(client, model, "probe").counts() == (0, 0)
    await stop(loops)


async def test_the_queue_bound_counts_both_workers(client):
    model, slots = f"flow-shared-{next(_models)}", Slots(1)
    (a, _), (b, _) = worker(client, slots, max_queued=2), worker(client, slots, max_queued=2)
    loops = [asyncio.create_task(w.run()) for w in (a, b)]
    served: list[tuple[str, asyncio.Event]] = []
    tasks = []
    for w, t in ((a, "x"), (a, "y"), (b, "z")):  # x takes the slot; y and z wait, one in each worker
        tasks.append(asyncio.create_task(serve(w, model, slots, t, served)))
        await asyncio.sleep(0.2)
    with pytest.raises(FlowRefused) as info:
        await b.acquire(model, entry("w"), False)
    assert info.value.reason == "queue_full"
    assert await one_at_a_time(served, 3) == ["x", "y", "z"]
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    await stop(loops)


async def test_a_request_that_cannot_be_served_by_its_deadline_is_refused_at_once(client):
    """Once the requests both workers served give a throughput, one whose estimated wait runs past
    its deadline gets 429 ``deadline`` at once, whichever worker it came to, with the estimate as
    its Retry-After; it leaves the shared queue, and a slot given meanwhile is never taken back."""
    model, slots = f"flow-shared-{next(_models)}", Slots(1)
    (a, _), (b, _) = worker(client, slots), worker(client, slots)
    loops = [asyncio.create_task(w.run()) for w in (a, b)]
    served: list[tuple[str, asyncio.Event]] = []
    tasks = [asyncio.create_task(serve(w, model, slots, "t", served)) for w in (a, b, a, b, a)]
    await asyncio.sleep(0.2)
    await one_at_a_time(served, 4)  # four served, one after another, over both workers; the fifth holds the slot
    tasks += [asyncio.create_task(serve(w, model, slots, "t", served)) for w in (a, b) * 3]
    await asyncio.sleep(0.3)
    assert await SharedQueue(client, model, "probe").counts() == (6, 1)
    now = time.monotonic()
    late = Entry(tenant="t", klass=1, cost=100.0, arrived=now, deadline=now + 0.2, weight=1.0)
    with pytest.raises(FlowRefused) as info:
        await b.acquire(model, late, False)
    assert time.monotonic() - now < 0.2  # at once, not when its deadline came
    assert info.value.reason == "deadline"
    # six requests of 100 tokens queued ahead of it and one more, at most 400 tokens a second
    # measured (four served within a second or so): 1.75 s or more
    retry = int(info.value.headers["retry-after-ms"]) / 1000
    assert 1.5 <= retry <= 7.0, retry
    print(f"retry after {retry:.2f} s")
    assert await SharedQueue(client, model, "probe").counts() == (6, 1)  # it left the queue
    assert len(await one_at_a_time(served, 11)) == 11  # the others are all served
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    await stop(loops)


async def test_a_preempted_request_gets_the_estimate_as_its_retry_after(client):
    """A queued batch request that a critical one displaces (the queue is full) is refused in the
    worker that held it with 429 ``preempted`` and, once the workers' requests give a throughput,
    the wait the estimate gives the back of its class as Retry-After, not the fixed default (1 s)."""
    model, slots = f"flow-shared-{next(_models)}", Slots(1)
    (a, _), (b, _) = worker(client, slots, max_queued=2), worker(client, slots, max_queued=2)
    loops = [asyncio.create_task(w.run()) for w in (a, b)]
    served: list[tuple[str, asyncio.Event]] = []
    tasks = []
    for i, w in enumerate((a, b, a, b, a)):  # 400 tokens served within a second or so; the fifth holds the slot
        tasks.append(asyncio.create_task(serve(w, model, slots, "t", served)))
        assert await wait_until_async(lambda: len(served) > i, 5)
        if i < 4:
            served[i][1].set()
    low = asyncio.create_task(a.acquire(model, entry("u", klass=0), False))
    tasks.append(asyncio.create_task(serve(b, model, slots, "v", served)))
    await asyncio.sleep(0.2)
    tasks.append(asyncio.create_task(serve(b, model, slots, "w", served, klass=2)))
    with pytest.raises(FlowRefused) as info:
        await asyncio.wait_for(low, 5)
    assert info.value.reason == "preempted"
    # at the back of the batch class: one standard request queued and one more, at 300-400 tokens a second
    retry = int(info.value.headers["retry-after-ms"]) / 1000
    assert 0.3 <= retry <= 0.9, retry
    assert await one_at_a_time(served, 7) == ["t"] * 5 + ["w", "v"]
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    await stop(loops)


async def test_an_entry_whose_enter_answer_was_lost_leaves_within_two_beats(client):
    """An enter Redis ran but whose answer the worker never read (a timeout after the call ran):
    the entry is this worker's in Redis, unknown to it. Left alone it would reach the head, take the
    slot and hold it for as long as the worker lives; the worker's beat takes it out instead, and
    the next request is served."""
    model, slots = f"flow-shared-{next(_models)}", Slots(1)
    a, _ = worker(client, slots)
    loop = asyncio.create_task(a.run())
    served: list[tuple[str, asyncio.Event]] = []
    first = asyncio.create_task(serve(a, model, slots, "t", served))
    assert await one_at_a_time(served, 1) == ["t"]
    await asyncio.wait_for(first, 5)
    lost = await SharedQueue(client, model, a.worker).enter(entry("lost"), a._local.rules(), int(time.time() * 1000))
    assert lost.status == "queued"
    probe = SharedQueue(client, model, "probe")
    await asyncio.sleep(0.3)
    assert await probe.counts() in ((1, 0), (0, 1))  # queued, or given the slot by a tick: held by no one
    for _ in range(60):  # two beats (1 s each) and a tick
        if await probe.counts() == (0, 0):
            break
        await asyncio.sleep(0.1)
    assert await probe.counts() == (0, 0)
    second = asyncio.create_task(serve(a, model, slots, "u", served))
    assert await one_at_a_time(served, 2) == ["t", "u"]  # the slot was not leaked
    await asyncio.wait_for(second, 5)
    await stop([loop])


async def test_a_starved_request_is_promoted_whichever_worker_holds_it(client):
    model, slots = f"flow-shared-{next(_models)}", Slots(1)
    classes = {"batch": FlowClass(promote_after_s=0.5)}
    (a, _), (b, _) = worker(client, slots, classes=classes), worker(client, slots, classes=classes)
    loops = [asyncio.create_task(w.run()) for w in (a, b)]
    served: list[tuple[str, asyncio.Event]] = []
    tasks = [asyncio.create_task(serve(a, model, slots, "x", served))]
    await asyncio.sleep(0.2)
    tasks.append(asyncio.create_task(serve(a, model, slots, "low", served, klass=0)))
    await asyncio.sleep(0.1)
    tasks += [asyncio.create_task(serve(b, model, slots, "std", served)) for _ in range(2)]
    await asyncio.sleep(1.0)  # the batch request waited past 0.5 s: now at the front of standard
    assert await one_at_a_time(served, 4) == ["x", "low", "std", "std"]
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    await stop(loops)


async def test_a_dead_workers_entries_and_slot_are_dropped(client):
    model, slots = f"flow-shared-{next(_models)}", Slots(1)
    (a, _), (b, _) = worker(client, slots, ttl_ms=600), worker(client, slots, ttl_ms=600)
    loop_a, loop_b = asyncio.create_task(a.run()), asyncio.create_task(b.run())
    served: list[tuple[str, asyncio.Event]] = []
    frozen = [asyncio.create_task(serve(a, model, slots, "a1", served))]
    await asyncio.sleep(0.2)
    frozen.append(asyncio.create_task(a.acquire(model, entry("a2"), False)))
    await asyncio.sleep(0.1)
    waiting_b = asyncio.create_task(serve(b, model, slots, "b1", served))
    await asyncio.sleep(0.3)
    assert await SharedQueue(client, model, "probe").counts() == (2, 1)
    await stop([loop_a])  # worker a dies: it neither beats nor tells Redis anything more
    slots.used = 0  # and the engine dropped its request
    for _ in range(100):
        if len(served) == 2:
            break
        await asyncio.sleep(0.05)
    assert [t for t, _ in served] == ["a1", "b1"]  # b's request got the dead worker's slot
    assert await SharedQueue(client, model, "probe").counts() == (0, 1)  # a2 went with a
    served[1][1].set()
    await asyncio.wait_for(waiting_b, 5)
    assert await SharedQueue(client, model, "probe").counts() == (0, 0)
    await stop([loop_b, *frozen])


async def test_while_redis_does_not_answer_requests_queue_in_the_worker():
    [port] = free_ports(1)
    down = redis.asyncio.from_url(f"redis://127.0.0.1:{port}")
    model, slots = "m", Slots(1)
    a, fallbacks = worker(down, slots)
    loop = asyncio.create_task(a.run())
    served: list[tuple[str, asyncio.Event]] = []
    tasks = [asyncio.create_task(serve(a, model, slots, t, served)) for t in ("x", "y")]
    assert await one_at_a_time(served, 2) == ["x", "y"]  # the second waited for the first's slot
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert fallbacks  # counted
    await stop([loop])
    await down.aclose()


async def test_a_request_waiting_in_redis_moves_to_the_worker_when_redis_stalls_and_leaves_redis_after(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    stalling = redis.asyncio.from_url(server.url, socket_timeout=0.3, socket_connect_timeout=0.3)
    admin = redis.asyncio.from_url(server.url)
    try:
        model, slots = "stall", Slots(1)
        a, fallbacks = worker(stalling, slots, retry_s=1.0)
        loop = asyncio.create_task(a.run())
        served: list[tuple[str, asyncio.Event]] = []
        tasks = [asyncio.create_task(serve(a, model, slots, "x", served))]
        await asyncio.sleep(0.2)
        tasks.append(asyncio.create_task(serve(a, model, slots, "y", served)))
        await asyncio.sleep(0.2)
        assert await SharedQueue(admin, model, "probe").counts() == (1, 1)
        await admin.execute_command("CLIENT", "PAUSE", "1500", "ALL")  # Redis stops answering for 1.5 s
        await asyncio.sleep(0.6)
        assert fallbacks  # y now waits in the worker's own queue
        assert await one_at_a_time(served, 2) == ["x", "y"]  # and takes x's slot while Redis is still stalled
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        probe = SharedQueue(admin, model, "probe")
        for _ in range(100):  # once Redis answers, y's entry and x's slot leave it
            if await probe.counts() == (0, 0):
                break
            await asyncio.sleep(0.05)
        assert await probe.counts() == (0, 0)
        await stop([loop])
    finally:
        await stalling.aclose()
        await admin.aclose()
        server.stop()


async def test_a_shared_queue_call_being_cancelled_never_returns(client):
    """redis-py 8.1's pipeline can swallow a cancellation (``execute`` returning normally while its
    task is being cancelled; llmesh.background.honour_cancel): every call cancelled before it
    returned raises CancelledError, whenever the cancel lands."""
    rng = random.Random(3)
    queue = SharedQueue(client, f"flow-shared-{next(_models)}", "probe")
    cancelled = n = 0
    while cancelled < 50 and n < 3000:  # until 50 cancels landed before Redis had answered
        n += 1
        call = asyncio.create_task(queue.counts() if n % 2 else queue.statuses(["a", "b", "c"]))
        await asyncio.sleep(rng.uniform(0.0, 0.001))
        if call.cancel():
            cancelled += 1
            with pytest.raises(asyncio.CancelledError):
                await call
        else:
            await call
    assert cancelled == 50


async def test_cancelled_loops_always_stop_whenever_the_cancel_lands(client):
    """redis-py 8.1's pipeline can swallow a cancellation (llmesh.background.honour_cancel): the
    workers' loops, cancelled at random moments while requests come and go, all stop."""
    rng = random.Random(11)
    for n in range(30):
        model, slots = f"flow-shared-{next(_models)}", Slots(1)
        (a, _), (b, _) = worker(client, slots), worker(client, slots)
        loops = [asyncio.create_task(w.run()) for w in (a, b)]
        served: list[tuple[str, asyncio.Event]] = []
        requests = [asyncio.create_task(serve(w, model, slots, t, served)) for w, t in ((a, "x"), (b, "y"))]
        await asyncio.sleep(rng.uniform(0.0, 0.15))
        for task in loops:
            task.cancel()
        _, pending = await asyncio.wait(loops, timeout=3)
        assert not pending, f"a loop still ran after its cancel, start {n}"
        await stop(requests)


async def test_a_request_cancelled_while_it_enters_leaves_nothing_in_the_shared_queue(client):
    """A client that goes while its entry is on its way to Redis: the entry is taken out once
    Redis has answered, so it holds neither a place nor, later, a slot."""
    rng = random.Random(5)
    model, slots = f"flow-shared-{next(_models)}", Slots(1)
    (a, _), (b, _) = worker(client, slots), worker(client, slots)
    loops = [asyncio.create_task(w.run()) for w in (a, b)]
    served: list[tuple[str, asyncio.Event]] = []
    holder = asyncio.create_task(serve(b, model, slots, "holder", served))  # the slot is taken: others queue
    assert await wait_until_async(lambda: len(served) == 1)
    for _ in range(40):
        req = asyncio.create_task(a.acquire(model, entry("gone"), False))
        await asyncio.sleep(rng.uniform(0.0, 0.002))
        req.cancel()
        await asyncio.gather(req, return_exceptions=True)
    probe = SharedQueue(client, model, "probe")
    counts: list[tuple[int, int]] = []

    async def settled() -> bool:
        counts.append(await probe.counts())
        return counts[-1] == (0, 1)  # only the holder's slot

    for _ in range(100):
        if await settled():
            break
        await asyncio.sleep(0.02)
    assert counts[-1] == (0, 1), counts[-1]
    served[0][1].set()
    await asyncio.wait_for(holder, 5)
    assert await probe.counts() == (0, 0)
    await stop(loops)

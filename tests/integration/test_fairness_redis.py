"""The shared fair order on a real redis-server (services/gateway/domain/fairness_redis.py):
two SharedQueue instances stand for two gateway workers; the order spanning both is the one
the in-process FairQueue gives on the same inputs, the queue depth and the slots are shared,
and a worker whose heartbeat lapsed has its entries dropped."""

from __future__ import annotations

import itertools

import pytest
import redis.asyncio

from llmesh.gateway.domain.fairness import ClassRule, Entry, FairQueue, Rules
from llmesh.gateway.domain.fairness_redis import SharedQueue

BATCH, STANDARD, CRITICAL = 0, 1, 2
_models = itertools.count()


@pytest.fixture
async def client(redis_server):
    c = redis.asyncio.from_url(redis_server.url)
    yield c
    await c.aclose()


def workers(client, n=2, ttl_ms=5000) -> list[SharedQueue]:
    model = f"fairness-redis-{next(_models)}"
    return [SharedQueue(client, model, f"w{i}", ttl_ms) for i in range(n)]


def entry(tenant: str, cost: float = 100, klass: int = STANDARD, weight: float = 1.0) -> Entry:
    return Entry(tenant=tenant, klass=klass, cost=cost, arrived=0.0, deadline=1e9, weight=weight)


async def drain(q: SharedQueue, owners: dict[str, str], rules: Rules) -> list[str]:
    """Releases one slot at a time (each done at once) and names the tenants in release order."""
    order = []
    while released := await q.release(1, 100, rules, 0):
        order.append(owners[released[0]])
        assert await q.leave(released[0]) == "released"
    return order


async def test_one_fair_order_spans_both_workers_and_matches_the_local_queue(client):
    rules = Rules()
    a, b = workers(client)
    local = FairQueue(rules)
    arrivals = [("heavy", 100, 1.0)] * 12 + [("light", 50, 1.0)] * 3 + [("heavy2", 300, 3.0)] * 4
    owners: dict[str, str] = {}
    for i, (tenant, cost, weight) in enumerate(arrivals):
        e = entry(tenant, cost, weight=weight)
        got = await (a if i % 2 else b).enter(e, rules, 0)  # the arrivals alternate between the workers
        assert got.status == "queued"
        owners[got.eid] = tenant
        local.offer(entry(tenant, cost, weight=weight), 0.0, free=0, total=100)
    expected = []
    while released := local.release(1, 100):
        expected.append(released[0].tenant)
        local.done(released[0])
    order = await drain(a, owners, rules)
    assert order == expected
    assert order.index("light") <= 1  # a light tenant is not behind the flood, whichever worker took it
    assert await a.counts() == (0, 0)


async def test_the_queue_depth_and_the_slots_are_shared(client):
    rules = Rules(max_queued=3)
    a, b = workers(client)
    ids = [(await q.enter(entry("t"), rules, 0)).eid for q in (a, b, a)]
    refused = await b.enter(entry("t"), rules, 0)
    assert refused.status == "queue_full"  # three queued over both workers fill the model's queue
    assert await b.counts() == (3, 0)
    first = await b.release(2, 4, rules, 0)  # worker b's view: two free of four slots
    assert first == ids[:2]
    assert await a.release(4, 4, rules, 0) == ids[2:]  # a sees four free, but only two are left
    assert await a.counts() == (0, 3)
    assert await a.release(4, 4, rules, 0) == []
    statuses = await a.statuses(ids)
    assert set(statuses.values()) == {"released"}  # the holder learns of it from the entry's status


async def test_bounds_per_tenant_and_preemption_of_a_lower_class(client):
    rules = Rules(max_queued_per_tenant=2, max_queued=3)
    a, b = workers(client)
    await a.enter(entry("t"), rules, 0)
    await b.enter(entry("t"), rules, 0)
    assert (await a.enter(entry("t"), rules, 0)).status == "tenant_queue_full"
    low = await b.enter(entry("u", klass=BATCH), rules, 0)
    high = await a.enter(entry("v", klass=CRITICAL), rules, 0)
    assert high.status == "queued" and high.victim == low.eid
    assert (await b.statuses([low.eid]))[low.eid] == "preempted"  # b reads why, then lets it go
    assert await b.leave(low.eid) == "preempted"
    assert await a.counts() == (3, 0)


async def test_at_its_bound_a_tenants_higher_class_entry_displaces_its_own_lower_class_one(client):
    """As the one-process queue's (tests/unit/test_fairness.py), over two workers."""
    rules = Rules(max_queued_per_tenant=2)
    a, b = workers(client)
    low = await a.enter(entry("t", klass=BATCH), rules, 0)
    await b.enter(entry("t"), rules, 0)
    high = await b.enter(entry("t", klass=CRITICAL), rules, 0)
    assert high.status == "queued" and high.victim == low.eid
    assert await a.leave(low.eid) == "preempted"
    assert (await a.enter(entry("t", klass=BATCH), rules, 0)).status == "tenant_queue_full"
    assert await a.counts() == (2, 0)


async def test_entries_a_free_slot_will_take_do_not_count_against_the_queue_bound(client):
    """A burst whose entries all enter before any release: with two slots free and room for four to
    wait, six enter (two of them leave at the next release), the seventh is refused. Counted
    naively the bound refused the fifth and sixth, which would never have waited."""
    rules = Rules(max_queued=4)
    a, b = workers(client)
    got = [await (a if i % 2 else b).enter(entry(f"t{i}"), rules, 0, free=2, total=2) for i in range(7)]
    assert [g.status for g in got] == ["queued"] * 6 + ["queue_full"]
    assert len(await a.release(2, 2, rules, 0)) == 2
    assert await a.counts() == (4, 2)
    late = await b.enter(entry("late"), rules, 0, free=2, total=2)  # both slots taken: the bound is whole
    assert late.status == "queue_full"


async def test_a_class_reservation_is_held_back_from_the_others(client):
    rules = Rules(classes={"critical": ClassRule(reserved_share=0.5)})
    a, b = workers(client)
    std = [(await a.enter(entry("s"), rules, 0)).eid for _ in range(4)]
    assert await a.release(4, 4, rules, 0) == std[:2]  # half of the four slots are critical's
    crit = (await b.enter(entry("c", klass=CRITICAL), rules, 0)).eid
    assert await b.release(2, 4, rules, 0) == [crit]


async def test_a_withdrawn_entry_charges_its_tenant_nothing(client):
    rules = Rules()
    a, b = workers(client)
    gone = await a.enter(entry("t", cost=1000), rules, 0)
    assert await a.leave(gone.eid) == "queued"
    owners = {(await a.enter(entry("t"), rules, 0)).eid: "t"}
    owners[(await b.enter(entry("u"), rules, 0)).eid] = "u"
    assert await drain(b, owners, rules) == ["t", "u"]  # t's withdrawn 1000 tokens did not push it back
    assert await a.leave(gone.eid) == ""


async def test_a_dead_workers_entries_and_slots_are_dropped(client):
    rules = Rules()
    a, b = workers(client, ttl_ms=1000)
    held = (await a.enter(entry("t"), rules, 0)).eid
    await a.enter(entry("t"), rules, 0)
    assert await a.release(1, 2, rules, 0) == [held]
    await b.enter(entry("u"), rules, 500)
    assert await b.counts() == (2, 1)
    await b.heartbeat(1500)  # a's heartbeat (at 0, for 1 s) lapsed; b's (at 500) holds
    assert await b.counts() == (1, 0)  # a's queued entry and its released one's slot are gone
    mine = await b.release(2, 2, rules, 1500)
    assert len(mine) == 1 and (await b.statuses(mine))[mine[0]] == "released"


async def test_a_starved_entry_is_promoted_to_the_front_of_the_next_class(client):
    rules = Rules(classes={"batch": ClassRule(promote_after_s=1.0)})
    a, b = workers(client)
    owners = {(await a.enter(entry("b", klass=BATCH), rules, 0)).eid: "b"}
    for _ in range(2):
        owners[(await b.enter(entry("s"), rules, 500)).eid] = "s"
    assert await b.promote(rules, 900) == []  # not yet: 0.9 s in its class
    assert await b.promote(rules, 1000) == list(owners)[:1]
    assert await a.counts() == (3, 0)
    assert await drain(a, owners, rules) == ["b", "s", "s"]  # without it, the batch entry went last


async def test_a_full_queue_sheds_the_longest_queue_in_the_class_for_a_shorter_one(client):
    rules = Rules(max_queued=3)
    a, b = workers(client)
    big = [(await q.enter(entry("big"), rules, 0)).eid for q in (a, b, a)]
    small = await b.enter(entry("small"), rules, 0)
    assert small.status == "queued" and small.victim == big[-1]  # big's newest gives way
    assert (await a.statuses([big[-1]]))[big[-1]] == "shed"
    assert (await a.enter(entry("big"), rules, 0)).status == "queue_full"  # big (2) is not longer than small + 1
    owners = {big[0]: "big", big[1]: "big", small.eid: "small"}
    assert await drain(a, owners, rules) == ["big", "small", "big"]


def _ms(t: float) -> int:
    return round(t * 1000)


async def _serve(q: SharedQueue, rules: Rules, running: list[tuple[float, str]], t: float, slots: int) -> list[str]:
    """At time ``t``: the requests due end (served), the freed slots go to the queue's heads, each for 1 s."""
    for end, eid in [r for r in running if r[0] <= t]:
        running.remove((end, eid))
        assert await q.leave(eid, now_ms=_ms(end), served=True) == "released"
    released = await q.release(slots - len(running), slots, rules, _ms(t))
    running += [(t + 1.0, eid) for eid in released]
    return released


async def test_the_shared_wait_estimate_is_close_to_the_real_wait(client):
    """As the one-process queue's (tests/unit/test_fairness.py): 4 slots of 1 s, 8 requests a second
    arriving at two workers; the throughput both measured gives a backlogged tenant's new entry a
    wait within 50 % of the wait it then really has."""
    rules = Rules()
    a, b = workers(client, ttl_ms=10**9)  # b enters nothing after the probe: its heartbeat must not lapse
    assert (await a.enter(entry("first"), rules, 0)).wait_s is None  # nothing served yet: no estimate
    running: list[tuple[float, str]] = []
    t, i = 0.0, 0
    while t < 10.0:
        while i / 8 <= t:  # the arrivals alternate between the workers
            assert (await (a if i % 2 else b).enter(entry(f"t{i % 3}"), rules, _ms(i / 8))).status == "queued"
            i += 1
        await _serve(a, rules, running, t, 4)
        t = round(t + 0.05, 6)
    await _serve(a, rules, running, t, 4)
    probe = await b.enter(entry("t0"), rules, _ms(t))  # a backlogged tenant's: behind its own and their turns
    assert probe.wait_s is not None
    start = t
    t = round(t + 0.05, 6)
    while probe.eid not in await _serve(a, rules, running, t, 4):  # the queue as it stands, no new arrivals
        t = round(t + 0.05, 6)
    real = t - start
    assert abs(probe.wait_s - real) <= 0.5 * real, (probe.wait_s, real)
    print(f"estimate {probe.wait_s:.2f} s, real wait {real:.2f} s")


async def _four_seconds_served(a: SharedQueue, b: SharedQueue, rules: Rules) -> None:
    """4 s of service over both workers: 40 requests of 100 tokens (the model's 1,000 tokens a
    second, 100 a request), 4 of them tenant ``heavy``'s (its 100 a second)."""
    for sec in range(4):
        for i in range(10):
            q = a if i % 2 else b
            got = await q.enter(entry("heavy" if i == 0 else f"other{i}"), rules, _ms(sec))
            assert await q.release(1, 100, rules, _ms(sec)) == [got.eid]
            assert await q.leave(got.eid, "done", _ms(sec), served=True) == "released"


async def test_a_refusal_at_a_full_queue_carries_its_estimated_wait(client):
    """As in one process, a request turned away (refused on arrival, or displaced from the queue
    by a higher class's) gets the wait the estimate gives the back of its class, as Retry-After."""
    rules = Rules(max_queued=3, max_queued_per_tenant=100)
    a, b = workers(client, ttl_ms=10**9)
    await _four_seconds_served(a, b, rules)
    low = await a.enter(entry("u", klass=BATCH), rules, _ms(4))
    for tenant in ("v", "w"):
        await a.enter(entry(tenant), rules, _ms(4))
    high = await b.enter(entry("x", klass=CRITICAL), rules, _ms(4))  # full: the batch entry gives way
    assert high.victim == low.eid
    assert await a.refusal_wait(low.eid) == pytest.approx(0.3)  # (200 queued at or above it + 100) / 1,000
    refused = await b.enter(entry("y", klass=BATCH), rules, _ms(4))  # nothing lower to displace
    assert refused.status == "queue_full" and refused.wait_s == pytest.approx(0.4)  # (300 + 100) / 1,000


async def test_a_backlogged_tenants_estimate_counts_its_own_share(client):
    """As the one-process queue's (tests/unit/test_fairness.py): the model served 1,000 tokens a
    second over both workers, of which this tenant got 100; with 1,000 of its own tokens queued
    ahead, its new entry waits (1,000 + 100) / 100 = 11 s by the estimate, not the 1.1 s the
    model's throughput alone says. Another tenant with nothing queued goes at the model's rate."""
    rules = Rules(max_queued_per_tenant=100)
    a, b = workers(client, ttl_ms=10**9)
    await _four_seconds_served(a, b, rules)
    for _ in range(10):
        assert (await a.enter(entry("heavy"), rules, _ms(4))).status == "queued"
    probe = await b.enter(entry("heavy"), rules, _ms(4))
    assert probe.wait_s == pytest.approx(11.0)
    light = await b.enter(entry("light"), rules, _ms(4))
    assert light.wait_s is not None and light.wait_s < 1.0
    for eid in (probe.eid, light.eid):  # a tenant's queued cost leaves with its entries
        assert await b.leave(eid) == "queued"
    assert float(await client.hget(a._p + f"ptc{STANDARD}", "heavy")) == 1000.0


async def test_a_deadline_leave_does_not_take_a_slot_just_given(client):
    rules = Rules()
    a, b = workers(client)
    got = await a.enter(entry("t"), rules, 0)
    assert await b.release(1, 1, rules, 0) == [got.eid]
    assert await a.leave(got.eid, "deadline", only_queued=True) == "released"  # it keeps its slot
    assert await a.counts() == (0, 1)
    queued = await a.enter(entry("t"), rules, 0)
    assert await a.leave(queued.eid, "deadline", only_queued=True) == "queued"
    assert await a.counts() == (0, 1)

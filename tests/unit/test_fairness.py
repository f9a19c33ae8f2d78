"""Flow control's fair queue on plain inputs (services/gateway/domain/fairness.py): token-weighted
fair order across tenants, classes with reserved shares, shedding and preemption of queued
requests only, promotion of a starved request, and deadline refusals from the estimate."""

from __future__ import annotations

from llmesh.gateway.domain.fairness import ClassRule, Entry, FairQueue, Rules, Throughput

BATCH, STANDARD, CRITICAL = 0, 1, 2


def entry(tenant: str, cost: float = 100, klass: int = STANDARD, weight: float = 1.0, deadline: float = 1e9,
          now: float = 0.0) -> Entry:
    return Entry(tenant=tenant, klass=klass, cost=cost, arrived=now, deadline=deadline, weight=weight)


def served_order(q: FairQueue, n: int) -> list[str]:
    out = []
    for _ in range(n):
        released = q.release(1, 100)
        if not released:
            break
        out.append(released[0].tenant)
        q.done(released[0])
    return out


def test_a_flooding_tenant_does_not_delay_a_light_one_past_its_fair_turn():
    q = FairQueue(Rules())
    for _ in range(10):
        q.offer(entry("heavy"), 0.0, free=0, total=10)
    q.offer(entry("light"), 0.0, free=0, total=10)
    order = served_order(q, 11)
    assert order.index("light") <= 1  # it went in at the front of the fair order, not behind ten


def test_served_tokens_follow_the_weights_whatever_the_rates():
    q = FairQueue(Rules())
    for _ in range(40):  # a tenant of weight 2 and one of weight 1, the second sending 4x more
        q.offer(entry("a", weight=2.0), 0.0, free=0, total=10)
    for _ in range(160):
        q.offer(entry("b"), 0.0, free=0, total=10)
    order = served_order(q, 30)
    assert order.count("a") == 20 and order.count("b") == 10


def test_cost_is_tokens_not_requests():
    q = FairQueue(Rules())
    for _ in range(10):
        q.offer(entry("big", cost=400), 0.0, free=0, total=10)
        q.offer(entry("small", cost=100), 0.0, free=0, total=10)
    order = served_order(q, 10)
    assert order.count("small") == 8 and order.count("big") == 2  # 800 tokens each


def test_an_idle_tenant_earns_no_credit():
    q = FairQueue(Rules())
    for _ in range(50):
        q.offer(entry("busy"), 0.0, free=0, total=10)
    served_order(q, 40)
    for _ in range(20):  # the newcomer starts at the virtual time now, not at zero
        q.offer(entry("new"), 0.0, free=0, total=10)
    order = served_order(q, 20)
    assert order.count("new") == 10 and order.count("busy") == 10


def test_a_higher_class_goes_first_and_an_unused_reservation_is_held_for_its_class():
    q = FairQueue(Rules(classes={"critical": ClassRule(reserved_share=0.2)}))
    for _ in range(10):
        q.offer(entry("b", klass=BATCH), 0.0, free=0, total=10)
    out = q.release(10, 10)  # 2 of the 10 slots are held for critical, which uses none
    assert len(out) == 8
    q.offer(c := entry("c", klass=CRITICAL), 0.0, free=0, total=10)
    q.offer(s := entry("s", klass=STANDARD), 0.0, free=0, total=10)
    assert q.release(1, 10) == [c]  # critical first, into its reserved slot
    assert q.release(1, 10) == []  # the last free slot is still critical's
    q.offer(c2 := entry("c", klass=CRITICAL), 0.0, free=0, total=10)
    assert q.release(2, 10) == [c2, s]


def test_a_full_queue_preempts_only_a_queued_lower_class_request():
    q = FairQueue(Rules(max_queued=2))
    running = q.offer(entry("b", klass=BATCH), 0.0, free=1, total=1)  # released: it holds the slot
    assert [r for _, r in running] == [None]
    q.offer(b1 := entry("b", klass=BATCH), 0.0, free=0, total=1)
    q.offer(entry("s"), 0.0, free=0, total=1)
    out = q.offer(c := entry("c", klass=CRITICAL), 0.0, free=0, total=1)
    assert [(e, r.reason) for e, r in out if r is not None] == [(b1, "preempted")]
    assert running[0][0].released and c.queued  # the request that already has its slot keeps it
    refused = q.offer(entry("s2"), 0.0, free=0, total=1)  # nothing lower queued: the newcomer is refused
    assert refused[0][1] is not None and refused[0][1].reason == "queue_full"


def test_a_full_queue_sheds_the_longest_queue_in_the_class_for_a_shorter_one():
    q = FairQueue(Rules(max_queued=4))
    heavy = [entry("heavy") for _ in range(4)]
    for e in heavy:
        q.offer(e, 0.0, free=0, total=1)
    out = q.offer(light := entry("light"), 0.0, free=0, total=1)
    assert [(e, r.reason) for e, r in out if r is not None] == [(heavy[-1], "shed")]
    assert light.queued and q.tenant_queued("heavy") == 3


def test_a_tenant_bound_refuses_the_tenant_not_the_others():
    q = FairQueue(Rules(max_queued_per_tenant=2))
    for _ in range(2):
        q.offer(entry("heavy"), 0.0, free=0, total=1)
    out = q.offer(entry("heavy"), 0.0, free=0, total=1)
    assert out[0][1] is not None and out[0][1].reason == "tenant_queue_full"
    out = q.offer(light := entry("light"), 0.0, free=0, total=1)
    assert out == [] and light.queued


def test_at_its_bound_a_tenants_higher_class_request_displaces_its_own_lower_class_one():
    q = FairQueue(Rules(max_queued_per_tenant=2))
    q.offer(low := entry("t", klass=BATCH), 0.0, free=0, total=1)
    q.offer(entry("t"), 0.0, free=0, total=1)
    out = q.offer(high := entry("t", klass=CRITICAL), 0.0, free=0, total=1)
    assert [(e, r.reason) for e, r in out if r is not None] == [(low, "preempted")]
    assert high.queued and q.tenant_queued("t") == 2
    out = q.offer(entry("t", klass=BATCH), 0.0, free=0, total=1)  # nothing of its own below: refused
    assert out[0][1] is not None and out[0][1].reason == "tenant_queue_full"


def test_a_starved_request_is_promoted_past_its_class_limit():
    q = FairQueue(Rules(classes={"batch": ClassRule(promote_after_s=10)}))
    q.offer(old := entry("batch", klass=BATCH), 0.0, free=0, total=1)
    for t in range(5):
        q.offer(entry(f"s{t}"), 5.0, free=0, total=1)
    assert q.promote(9.9) == []
    assert q.promote(10.0) == [old]
    assert old.klass == STANDARD and q.queued_in(BATCH) == 0
    assert q.release(1, 1) == [old]  # at the front of its new class's fair order


def test_a_request_leaves_the_queue_at_its_deadline():
    q = FairQueue(Rules())
    q.offer(e := entry("t", deadline=5.0), 0.0, free=0, total=1)
    assert q.next_deadline() == 5.0
    assert q.expire(4.9) == []
    [(gone, why)] = q.expire(5.0)
    assert gone is e and why.reason == "expired" and not e.queued
    assert q.release(1, 1) == []


def simulate(q: FairQueue, meter: Throughput, slots: int, service_s: float, arrivals: list[Entry],
             until: float, step: float = 0.01) -> dict[int, float]:
    """A fake clock: ``slots`` servers, each request served in ``service_s``; returns each
    released entry's wait (by seq), recording finishes into ``meter``."""
    running: list[tuple[float, Entry]] = []
    waits: dict[int, float] = {}
    t = 0.0
    while t < until:
        for end, e in [r for r in running if r[0] <= t]:
            running.remove((end, e))
            q.done(e)
            meter.record(t, e.cost)
        while arrivals and arrivals[0].arrived <= t:
            e = arrivals.pop(0)
            for x, why in q.offer(e, t, slots - len(running), slots):
                if why is None:
                    waits[x.seq] = t - x.arrived
                    running.append((t + service_s, x))
        for x in q.release(slots - len(running), slots):
            waits[x.seq] = t - x.arrived
            running.append((t + service_s, x))
        t = round(t + step, 6)
    return waits


def test_a_deadline_refusal_carries_a_retry_after_close_to_the_real_wait():
    q, meter = FairQueue(Rules()), Throughput(window_s=30)
    # 4 slots, 1 s each, 8 requests a second: a backlog builds; the throughput is measured from finishes
    arrivals = [entry(f"t{i % 3}", now=i / 8) for i in range(160)]
    simulate(q, meter, 4, 1.0, arrivals, until=10.0)
    now = 10.0
    rate, mean = meter.rate(now), meter.mean_cost()
    assert rate is not None
    out = q.offer(late := entry("probe", deadline=now + 0.5, now=now), now, 0, 4, rate, mean)
    [(refused, why)] = [(e, r) for e, r in out if r is not None]
    assert refused is late and why.reason == "deadline"
    # the same request without a deadline: how long it really waits
    probe = entry("probe", now=now)
    q.offer(probe, now, 0, 4, rate, mean)
    real = _wait_for(q, meter, probe, now, slots=4, service_s=1.0)
    assert abs(why.retry_after_s - real) <= 0.5 * real, (why.retry_after_s, real)
    print(f"estimate {why.retry_after_s:.2f} s, real wait {real:.2f} s")


def _wait_for(q: FairQueue, meter: Throughput, probe: Entry, now: float, slots: int, service_s: float) -> float:
    """Serves the queue as it stands (no new arrivals) until ``probe`` gets a slot."""
    ends = [now + service_s * (i + 1) / slots for i in range(slots)]  # slots held by the backlog, staggered
    while True:
        t = min(ends)
        ends.remove(t)
        for e in q.release(1, slots):
            if e is probe:
                return t - now
            ends.append(t + service_s)


def test_throughput_is_unknown_until_enough_requests_finished():
    meter = Throughput(min_samples=4)
    for t in range(3):
        meter.record(float(t), 100)
    assert meter.rate(3.0) is None
    meter.record(3.0, 100)
    assert meter.rate(3.0) == 100.0 and meter.mean_cost() == 100
    assert meter.rate(100.0) is None  # the window moved past them


def test_a_quiet_tenants_burst_goes_ahead_within_its_credit_only():
    q = FairQueue(Rules(burst_tokens=200))
    for _ in range(20):
        q.offer(entry("heavy"), 0.0, free=0, total=10)
    served_order(q, 10)
    for _ in range(4):  # 400 tokens at once: the first 2 go ahead of the backlog, the rest take turns
        q.offer(entry("light"), 0.0, free=0, total=10)
    assert served_order(q, 4) == ["light", "light", "light", "heavy"]


def test_quiet_slots_are_left_to_a_tenant_with_nothing_waiting():
    q = FairQueue(Rules(quiet_share=0.2))
    for _ in range(20):
        q.offer(entry("heavy"), 0.0, free=0, total=10)
    assert len(q.release(10, 10)) == 8  # the backlog leaves 2 of 10 slots free
    q.offer(light := entry("light"), 0.0, free=0, total=10)
    assert q.release(2, 10) == [light]  # it had nothing waiting: it takes one of them, the backlog none


def test_a_backlogged_tenants_estimate_counts_its_own_share():
    q = FairQueue(Rules())
    for _ in range(10):
        q.offer(entry("heavy"), 0.0, free=0, total=10)
    # 1000 tokens of its own ahead; the model serves 1000 tokens/s but this tenant gets 100 of them
    out = q.offer(entry("heavy", deadline=5.0), 0.0, free=0, total=10, rate=1000.0, mean_cost=100.0,
                  tenant_rate=100.0)
    [(_, why)] = out
    assert why is not None and why.reason == "deadline" and why.retry_after_s == 11.0
    out = q.offer(light := entry("light", deadline=5.0), 0.0, free=0, total=10, rate=1000.0, mean_cost=100.0)
    assert out == [] and light.queued  # it has nothing ahead of its own: it goes at the model's rate


def test_a_refused_request_charges_its_tenant_nothing():
    q = FairQueue(Rules(max_queued_per_tenant=1))
    q.offer(first := entry("a"), 0.0, free=0, total=10)
    q.offer(entry("a"), 0.0, free=0, total=10)  # refused: tenant_queue_full
    q.offer(second := entry("a"), 0.0, free=0, total=10)  # refused too
    assert second.start == first.finish

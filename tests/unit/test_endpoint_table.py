import asyncio

from llmesh.scheduler.table import EndpointState, EndpointTable, Load


def state(eid="e1", running=0, now=0.0, draining=False) -> EndpointState:
    return EndpointState(endpoint_id=eid, address="127.0.0.1:1", backend="sim", models=("m",),
                         load=Load(running=running), draining=draining, last_report=now)


async def test_upsert_bumps_version_only_on_real_change():
    t = EndpointTable()
    await t.upsert(state(now=1.0))
    v = t.version
    await t.upsert(state(now=2.0))  # heartbeat: same content
    assert t.version == v
    await t.upsert(state(running=1, now=3.0))
    assert t.version == v + 1


async def test_stale_endpoints_turn_unhealthy_and_recover_on_report():
    t = EndpointTable(stale_after_s=3.0)
    await t.upsert(state(now=0.0))
    await t.expire(now=2.0)
    assert t.snapshot()[0].healthy
    await t.expire(now=3.5)
    assert not t.snapshot()[0].healthy
    await t.upsert(state(now=4.0))
    assert t.snapshot()[0].healthy


async def test_draining_endpoint_is_unhealthy_and_removal_wakes_watchers():
    t = EndpointTable()
    await t.upsert(state(draining=True))
    assert not t.snapshot()[0].healthy
    seen = t.version
    waiter = asyncio.create_task(t.wait_for_change(seen))
    await asyncio.sleep(0)
    await t.remove("e1")
    assert await asyncio.wait_for(waiter, 1) == seen + 1
    assert t.snapshot() == []


async def test_a_failed_self_test_makes_the_endpoint_unhealthy_until_it_passes():
    from dataclasses import replace

    t = EndpointTable()
    await t.upsert(replace(state(), self_test_ok=False))
    assert not t.snapshot()[0].healthy
    await t.upsert(replace(state(now=1.0), self_test_ok=True))
    assert t.snapshot()[0].healthy

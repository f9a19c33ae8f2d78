"""Gateway processes sharing their load ledgers through a real redis-server
(services/gateway/upstream/ledger_share.py): one's requests in flight show in the other's
peers within a few rounds and leave with them (telling flow control); a process that stops
publishing (killed) is left out once its snapshot stops changing, and one that leaves takes
its field out; while Redis does not answer, answers late (a server busy for seconds) or
answers with an error, a process routes on its own counts, and shares again after."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import pytest
import redis.asyncio

from llmesh.testing import RedisServer, wait_until_async
from llmesh.gateway.upstream.ledger_share import CHANNEL, KEY, LedgerShare
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker, PickInput


def picker() -> EndpointPicker:
    p = EndpointPicker()
    p.replace_all([Endpoint(e, e, frozenset({"m"}), max_running=4) for e in ("e1", "e2")])
    return p


def e1(p: EndpointPicker) -> Endpoint:
    return next(e for e in p.all() if e.endpoint_id == "e1")


async def stop(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.wait(tasks, timeout=5)  # bounded: CI once saw this cleanup hang until pytest's 300 s timeout


async def subscribed(client, n: int, timeout_s: float = 5.0) -> bool:
    """Whether ``n`` processes listen for pushes within ``timeout_s`` (a push sent before a
    listener subscribed is not heard: the channel keeps nothing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if dict(await client.pubsub_numsub(CHANNEL)).get(CHANNEL.encode(), 0) >= n:
            return True
        await asyncio.sleep(0.02)
    return False


@pytest.fixture
async def client(redis_server):
    c = redis.asyncio.from_url(redis_server.url)
    await c.delete(KEY)
    yield c
    await c.delete(KEY)
    await c.aclose()


async def test_each_process_sees_the_others_work_in_flight_and_a_killed_one_lapses(client):
    a, b = picker(), picker()
    drops: list[int] = []
    share_a = LedgerShare(client, a.local, interval_s=0.02, name="a")
    share_b = LedgerShare(client, b.local, interval_s=0.02, name="b", on_drop=lambda: drops.append(1))
    tasks = [asyncio.create_task(share_a.run()), asyncio.create_task(share_b.run())]
    try:
        tickets = [a.acquire("e1", 100) for _ in range(3)]
        b.acquire("e2", 10)
        assert await wait_until_async(lambda: b.local.requests(e1(b)) == 3), b.local.peers
        assert b.local.all_of("prefill_tokens", "e1") == 300 and b.local.all_of("prefill_tokens", "e2") == 10
        assert await wait_until_async(lambda: a.local.peers.get("e2 e2") == (10, 1, 0, 0, 1))  # and a sees b's
        assert b.pick(PickInput("m", 0.0, work_tokens=10), "least_loaded").endpoint_id == "e2"
        assert b.capacity(PickInput("m", 0.0))[0] == 8 - 3 - 1  # flow control's free slots count a's too
        for t in tickets:
            a.started(t)
        assert await wait_until_async(lambda: b.local.decoding(e1(b)) == 3
                                      and b.local.all_of("prefill_tokens", "e1") == 0)
        assert not drops
        for t in tickets:
            a.release("e1", 100, t)
        assert await wait_until_async(lambda: b.local.requests(e1(b)) == 0)
        assert drops  # the peers' work in flight went down: flow control is told
        # a is killed: its loop stops, its field stays, unchanged; b leaves it out after 1 s (20 rounds, at least 1 s)
        a.acquire("e1", 100)
        assert await wait_until_async(lambda: b.local.requests(e1(b)) == 1)
        tasks[0].cancel()
        stopped = time.monotonic()
        assert await wait_until_async(lambda: b.local.requests(e1(b)) == 0, 5.0)
        assert time.monotonic() - stopped >= 0.9
        assert await client.hexists(KEY, "a")  # until it has been unchanged for a minute
        # a process started after a's death never counts a's last snapshot
        c = picker()
        share_c = LedgerShare(client, c.local, interval_s=0.02, name="c")
        tasks.append(asyncio.create_task(share_c.run()))
        await asyncio.sleep(0.3)
        assert c.local.requests(e1(c)) == 0 and c.local.peers.get("e2 e2") == (10, 1, 0, 0, 1)
    finally:
        await stop(tasks)
    assert await client.hexists(KEY, "b")
    await share_b.leave()  # a clean stop takes its field out
    assert not await client.hexists(KEY, "b")


async def test_a_field_unchanged_for_a_minute_is_dropped_from_the_store(client):
    clock = [0.0]
    b = picker()
    share_b = LedgerShare(client, b.local, interval_s=0.02, name="b", clock=lambda: clock[0])
    await client.hset(KEY, mapping={"dead": json.dumps({"v": 1, "s": 5, "i": 0.05, "e": {}}), "junk": "x"})
    await share_b.sync()
    assert await client.hlen(KEY) == 3
    clock[0] = 61.0
    await share_b.sync()
    assert sorted(await client.hkeys(KEY)) == [b"b"]


async def test_a_store_that_errs_stalls_or_goes_leaves_each_process_on_its_own_then_shares_again(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    c = redis.asyncio.from_url(server.url, socket_timeout=10, socket_connect_timeout=2)  # production's patience
    admin = redis.asyncio.from_url(server.url)
    b = picker()
    rounds: list[int | None] = []  # what the gateway's llmesh_ledger_peers and _share_failures are fed
    share_b = LedgerShare(c, b.local, interval_s=0.02, retry_s=0.1, name="b", on_round=rounds.append)
    peer = {"e1 e1": [0, 0, 0, 0, 2]}  # engine e1 at address e1

    async def peer_a() -> None:  # another process publishing two requests in flight on e1, round after round
        for n in range(1, 1_000_000):
            try:
                await admin.hset(KEY, "a", json.dumps({"v": 1, "s": n, "i": 0.02, "e": peer}))
            except redis.exceptions.RedisError:
                pass
            await asyncio.sleep(0.02)

    shared = lambda: b.local.peers == {"e1 e1": (0, 0, 0, 0, 2)}  # noqa: E731
    tasks = [asyncio.create_task(share_b.run()), asyncio.create_task(peer_a())]
    try:
        assert await wait_until_async(shared)
        # an error reply (the key overwritten with another type): alone, and the loop goes on
        await admin.delete(KEY)
        await admin.set(KEY, "not a hash")
        assert 1 in rounds  # a counted
        assert await wait_until_async(lambda: rounds[-1] is None and b.local.peers == {}, 3.0)  # failed rounds
        await admin.delete(KEY)
        assert await wait_until_async(shared, 5.0) and not tasks[0].done()
        assert await wait_until_async(lambda: rounds[-1] == 1)
        # a server that stops answering (SIGSTOP) for 3 s: the round gives up after 1 s, not the client's 10
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            assert await wait_until_async(lambda: b.local.peers == {}, 2.5)
            assert time.monotonic() - began < 2.0
            await asyncio.sleep(3 - (time.monotonic() - began))
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert await wait_until_async(shared, 5.0)
        server.stop()  # gone
        assert await wait_until_async(lambda: b.local.peers == {}, 5.0) and not tasks[0].done()
    finally:
        await stop(tasks)
        await c.aclose()
        await admin.aclose()
        server.stop()


async def test_a_change_reaches_the_others_between_rounds_even_after_a_quiet_spell(client, redis_server):
    """Rounds every 2 s: a request started, then ended, shows in the other's view within
    a fraction of a round, pushed, also after longer than the client's socket timeout idle."""
    client = redis.asyncio.from_url(redis_server.url, socket_timeout=2.0, socket_connect_timeout=2.0)  # the gateway's
    a, b = picker(), picker()
    share_a = LedgerShare(client, a.local, interval_s=2.0, name="a")
    share_b = LedgerShare(client, b.local, interval_s=2.0, name="b")
    a.on_ledger.append(share_a.changed)
    tasks = [asyncio.create_task(share_a.run()), asyncio.create_task(share_b.run())]
    try:
        assert await subscribed(client, 2)
        assert await wait_until_async(lambda: share_a.others == 1, 5.0)  # a pushes once it knows of b
        a.acquire("e1", 100)  # pushed: b counts a at once, whether or not its first round read a's field
        assert await wait_until_async(lambda: b.local.requests(e1(b)) == 1, 1.0), b.local.peers
        for _ in range(2):
            await asyncio.sleep(2.5)  # quiet for longer than the socket timeout (2 s in the gateway)
            began = time.monotonic()
            t = a.acquire("e1", 100)
            assert await wait_until_async(lambda: b.local.requests(e1(b)) == 2, 1.0), b.local.peers
            a.release("e1", 100, t)
            assert await wait_until_async(lambda: b.local.requests(e1(b)) == 1, 1.0), b.local.peers
            assert time.monotonic() - began < 0.5
    finally:
        await stop(tasks)
        await client.aclose()


async def test_a_process_alone_in_the_store_pushes_nothing_until_another_appears(client):
    """Pushes cost CPU on every change of the ledger: a lone gateway process (one replica, one
    worker, with a Redis) sends none; once another process's field is in the store, it does."""
    a = picker()
    share_a = LedgerShare(client, a.local, interval_s=0.02, name="a")
    a.on_ledger.append(share_a.changed)
    listener = client.pubsub()
    await listener.subscribe(CHANNEL)

    async def pushes(within_s: float) -> int:
        n, deadline = 0, time.monotonic() + within_s
        while time.monotonic() < deadline:
            message = await listener.get_message(ignore_subscribe_messages=True, timeout=0.05)
            n += message is not None
        return n

    tasks = [asyncio.create_task(share_a.run())]
    try:
        assert await wait_until_async(lambda: share_a.others == 0 and a.local.peers == {}, 1.0)
        await asyncio.sleep(0.1)  # some rounds, alone
        t = a.acquire("e1", 100)
        a.release("e1", 100, t)
        assert await pushes(0.5) == 0 and await client.hexists(KEY, "a")  # its rounds still write
        await client.hset(KEY, "b", json.dumps({"v": 1, "s": 1, "i": 0.02, "e": {}}))
        assert await wait_until_async(lambda: share_a.others == 1)
        a.acquire("e1", 100)
        assert await pushes(0.5) >= 1
    finally:
        await stop(tasks)
        await listener.aclose()


async def test_a_cancelled_share_always_stops_whenever_the_cancel_lands(client):
    """redis-py 8.1's pipeline can swallow a cancellation (``execute`` returning normally while its
    task is being cancelled): without ``honour_cancel`` one start-and-cancel in 5-25 left a share
    looping for good here (a stop that hung a test's cleanup, a worker that never exited)."""
    rng = random.Random(7)
    for n in range(150):
        a, b = picker(), picker()
        shares = [LedgerShare(client, a.local, interval_s=0.02, name="a"),
                  LedgerShare(client, b.local, interval_s=0.02, name="b")]
        a.on_ledger.append(shares[0].changed)
        tasks = [asyncio.create_task(s.run()) for s in shares]
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        t = a.acquire("e1", 10)
        a.release("e1", 10, t)
        for task in tasks:
            task.cancel()
        _, pending = await asyncio.wait(tasks, timeout=3)
        assert not pending, f"still running after its cancel, start {n}"

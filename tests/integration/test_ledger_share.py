"""Gateway processes sharing their load ledgers through a real redis-server
(services/gateway/upstream/ledger_share.py): one's requests in flight show in the other's
peers within a few rounds and leave with them; a process that stops publishing (killed) is
left out once its snapshot stops changing, and one that leaves takes its field out; while
Redis does not answer, a process routes on its own counts."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio
import redis.exceptions

from llmesh.testing import RedisServer
from llmesh.gateway.upstream.ledger_share import KEY, LedgerShare
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker, PickInput

ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def picker() -> EndpointPicker:
    p = EndpointPicker()
    p.replace_all([Endpoint(e, e, frozenset({"m"}), max_running=4) for e in ("e1", "e2")])
    return p


async def until(check, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()


@pytest.fixture
async def client(redis_server):
    c = redis.asyncio.from_url(redis_server.url)
    await c.delete(KEY)
    yield c
    await c.delete(KEY)
    await c.aclose()


async def test_each_process_sees_the_others_work_in_flight_and_a_killed_one_lapses(client):
    a, b = picker(), picker()
    share_a = LedgerShare(client, a.local, interval_s=0.02, errors=ERRORS, name="a")
    share_b = LedgerShare(client, b.local, interval_s=0.02, errors=ERRORS, name="b")
    tasks = [asyncio.create_task(share_a.run()), asyncio.create_task(share_b.run())]
    try:
        tickets = [a.acquire("e1", 100) for _ in range(3)]
        e1 = next(e for e in b.all() if e.endpoint_id == "e1")
        assert await until(lambda: b.local.requests(e1) == 3), b.local.peers
        assert b.local.all_of("prefill_tokens", "e1") == 300 and a.local.peers == {}  # a sees none of b's
        assert b.pick(PickInput("m", 0.0, work_tokens=10), "least_loaded").endpoint_id == "e2"
        for t in tickets:
            a.started(t)
        assert await until(lambda: b.local.decoding(e1) == 3 and b.local.all_of("prefill_tokens", "e1") == 0)
        for t in tickets:
            a.release("e1", 100, t)
        assert await until(lambda: b.local.requests(e1) == 0)
        # a is killed: its loop stops, its field stays, unchanged; b leaves it out after 1 s (20 rounds, at least 1 s)
        a.acquire("e1", 100)
        assert await until(lambda: b.local.requests(e1) == 1)
        tasks[0].cancel()
        stopped = time.monotonic()
        assert await until(lambda: b.local.requests(e1) == 0, 5.0)
        assert time.monotonic() - stopped >= 0.9
        assert await client.hexists(KEY, "a")  # until forget_s (60 s) it stays in the store
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert await client.hexists(KEY, "b")
    await share_b.leave()  # a clean stop takes its field out
    assert not await client.hexists(KEY, "b")


async def test_without_redis_a_process_routes_on_its_own_counts(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    c = redis.asyncio.from_url(server.url, socket_timeout=0.3, socket_connect_timeout=0.3)
    b = picker()
    share_b = LedgerShare(c, b.local, interval_s=0.02, errors=ERRORS, retry_s=0.1, name="b")

    async def peer_a() -> None:  # another process publishing two requests in flight on e1, round after round
        for n in range(1, 100_000):
            await c.hset(KEY, "a", '{"s": %d, "e": {"e1": [0, 0, 0, 0, 2, 0]}}' % n)
            await asyncio.sleep(0.02)

    tasks = [asyncio.create_task(share_b.run()), asyncio.create_task(peer_a())]
    try:
        assert await until(lambda: b.local.peers == {"e1": (0, 0, 0, 0, 2, 0)})
        server.stop()
        assert await until(lambda: b.local.peers == {}, 5.0)  # Redis gone: its own view only
        assert not tasks[0].done()  # and it keeps trying
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await c.aclose()
        server.stop()

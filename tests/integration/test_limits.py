"""The limiter's semantics, the same in-process and on a real redis-server."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import redis.asyncio

from llmesh.testing import RedisServer
from llmesh.gateway.domain.limits import WINDOW_MS, Ask, FallbackLimiter, LocalLimiter, Outcome, usage_key
from llmesh.gateway.domain.limits_redis import RedisLimiter

_ids = itertools.count()


@pytest.fixture(params=["local", "redis"])
async def limiter(request, redis_server):
    if request.param == "local":
        yield LocalLimiter()
        return
    client = redis.asyncio.from_url(redis_server.url)
    await client.flushdb()
    yield RedisLimiter(client)
    await client.aclose()


def ask(tenant="t", tokens=10, **kw) -> Ask:
    return Ask(tenant=tenant, rid=f"r{next(_ids)}", tokens=tokens, **kw)


async def test_requests_per_minute_is_a_sliding_window(limiter):
    t0 = 1_000_000
    results = [await limiter.admit(ask(rpm=3), t0 + i) for i in range(4)]
    assert [v.ok for v in results] == [True, True, True, False]
    refused = results[-1]
    assert refused.limit == "requests"
    assert refused.retry_after_ms == WINDOW_MS - 3  # the first entry leaves the window then
    assert (await limiter.admit(ask(rpm=3), t0 + WINDOW_MS + 1)).ok  # one left the window


async def test_tokens_per_minute_reserve_then_reconcile(limiter):
    t0 = 2_000_000
    first = ask(tokens=600, tpm=1000)
    v1 = await limiter.admit(first, t0)
    assert v1.ok and v1.tokens_used == 600
    second = await limiter.admit(ask(tokens=600, tpm=1000), t0 + 1)
    assert not second.ok and second.limit == "tokens" and second.retry_after_ms == WINDOW_MS - 1
    # The first used only 100 of its 600: reconciling frees the rest at once.
    await limiter.settle(first, v1, Outcome("m", "2026-01-01", 40, 60, 0))
    assert (await limiter.admit(ask(tokens=600, tpm=1000), t0 + 2)).ok
    too_big = await limiter.admit(ask(tokens=2000, tpm=1000), t0 + 3)
    assert not too_big.ok and too_big.limit == "tokens"


async def test_concurrency_leases_are_released_and_expire(limiter):
    t0 = 3_000_000
    a, b = ask(concurrency=2, lease_ms=5000), ask(concurrency=2, lease_ms=5000)
    va, vb = await limiter.admit(a, t0), await limiter.admit(b, t0)
    assert va.ok and vb.ok
    third = await limiter.admit(ask(concurrency=2, lease_ms=5000), t0 + 1)
    assert not third.ok and third.limit == "concurrency"
    await limiter.settle(a, va, None)
    assert (await limiter.admit(ask(concurrency=2, lease_ms=5000), t0 + 2)).ok
    # b's lease expires with its gateway gone
    assert (await limiter.admit(ask(concurrency=2, lease_ms=5000), t0 + 6000)).ok


async def test_budget_stops_after_the_request_that_crosses_it(limiter):
    t0 = 4_000_000
    spent = 0
    admitted = 0
    for i in range(10):
        a = ask(tenant="b", tokens=100, budget_key="budget:b:day", budget_tokens=250, budget_reset_ms=5000)
        v = await limiter.admit(a, t0 + i)
        if not v.ok:
            assert v.limit == "budget" and v.retry_after_ms == 5000
            break
        admitted += 1
        await limiter.settle(a, v, Outcome("m", "2026-01-01", 50, 50, 0))
        spent += 100
    assert admitted == 3 and spent - 250 < 100  # at most one request past the line


async def test_concurrent_reservations_count_against_the_budget(limiter):
    asks = [ask(tenant="c", tokens=100, budget_key="budget:c", budget_tokens=250, budget_reset_ms=1000)
            for _ in range(6)]
    verdicts = await asyncio.gather(*(limiter.admit(a, 5_000_000) for a in asks))
    assert sum(v.ok for v in verdicts) == 3  # 0, 100, 200 < 250: the third crosses, then none


async def test_usage_is_counted_per_tenant_model_and_day(redis_server):
    client = redis.asyncio.from_url(redis_server.url)
    await client.flushdb()
    lim = RedisLimiter(client)
    a = ask(tenant="u")
    v = await lim.admit(a, 6_000_000)
    await lim.settle(a, v, Outcome("smol", "2026-11-30", 7, 9, 42))
    await lim.settle(a, v, Outcome("smol", "2026-11-30", 1, 1, 1))
    raw = {k.decode(): int(v) for k, v in (await client.hgetall(usage_key("2026-11-30"))).items()}
    assert raw == {"u\tsmol\trequests": 2, "u\tsmol\tprompt_tokens": 8, "u\tsmol\tcompletion_tokens": 10,
                   "u\tsmol\tmicro_usd": 43}
    await client.aclose()


async def test_fallback_serves_while_redis_is_down_and_writes_usage_back(tmp_path):
    import redis.exceptions as rexc
    server = RedisServer(tmp_path / "redis")
    server.start()
    client = redis.asyncio.from_url(server.url, socket_timeout=0.3, socket_connect_timeout=0.3)
    clock = [0.0]
    fb = FallbackLimiter(RedisLimiter(client), LocalLimiter(), retry_s=1.0,
                         errors=(rexc.ConnectionError, rexc.TimeoutError, OSError), clock=lambda: clock[0])
    try:
        assert (await fb.admit(ask(tenant="f", rpm=2), 7_000_000)).where == "redis"
        server.stop()
        a = ask(tenant="f", rpm=2)
        v = await fb.admit(a, 7_000_001)
        assert v.ok and v.where == "local"
        await fb.settle(a, v, Outcome("m", "2026-11-30", 3, 4, 0))
        assert (await fb.admit(ask(tenant="f", rpm=2), 7_000_002)).ok  # the local log has room for one more
        assert not (await fb.admit(ask(tenant="f", rpm=2), 7_000_003)).ok
        server.start()  # same port, empty
        clock[0] = 2.0  # past the retry interval: Redis is asked again
        v = await fb.admit(ask(tenant="f", rpm=2), 7_000_004)
        assert v.where == "redis" and v.ok
        usage = {k.decode(): int(x) for k, x in (await client.hgetall(usage_key("2026-11-30"))).items()}
        assert usage["f\tm\tprompt_tokens"] == 3 and usage["f\tm\trequests"] == 1
    finally:
        await client.aclose()
        server.stop()

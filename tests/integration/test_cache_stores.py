"""One contract for both cache stores: the in-process one and Redis (a real
redis-server). Same calls, same results."""

import asyncio
import uuid

import pytest

from llmesh.cache.memory import MemoryStore
from llmesh.cache.redis_store import RedisStore
from llmesh.cache.store import Entry, Name, Selector


@pytest.fixture(params=["memory", "redis"])
async def make_store(request, redis_server):
    made = []

    def make(cap: int = 100):
        if request.param == "memory":
            store = MemoryStore(cap)
        else:
            store = RedisStore(redis_server.url, cap, timeout_s=2.0, namespace=f"test:{uuid.uuid4().hex}")
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


def x(tenant="t", model="m", digest="aa01"):
    return Name(tenant, model, "x", digest)


async def test_put_then_get_round_trips_exact_and_semantic_entries(make_store):
    store = make_store()
    await store.put(x(), Entry(b"answer"), ttl_s=60)
    sem = Name("t", "m", "s", "bb02")
    entry = Entry(b"answer2", vector=b"\x00\x01" * 8, text="how do I reset it?", scope="scope1")
    await store.put(sem, entry, ttl_s=60)
    assert await store.get(x()) == Entry(b"answer")
    assert await store.get(sem) == entry
    assert await store.get(x(digest="ffff")) is None
    listed = [s async for s in store.semantic_entries()]
    assert [(s.name, s.entry) for s in listed] == [(sem, entry)]
    assert 0 < listed[0].ttl_left_s <= 60


async def test_entries_expire(make_store):
    store = make_store()
    await store.put(x(), Entry(b"v"), ttl_s=0.2)
    await store.put(Name("t", "m", "s", "cc"), Entry(b"v", b"\0" * 4, "q", "s"), ttl_s=0.2)
    assert await store.get(x()) is not None
    await asyncio.sleep(0.35)
    assert await store.get(x()) is None
    assert [s async for s in store.semantic_entries()] == []
    assert (await store.stats("t"))["t"].entries == 0


async def test_each_tenant_keeps_its_most_recently_used_entries_under_its_cap(make_store):
    store = make_store(cap=3)
    for d in ("01", "02", "03"):
        await store.put(x(digest=d), Entry(d.encode()), ttl_s=60)
        await asyncio.sleep(0.01)
    await store.put(x(tenant="other", digest="09"), Entry(b"o"), ttl_s=60)
    assert await store.get(x(digest="01")) is not None  # now the most recently used
    await asyncio.sleep(0.01)
    evicted = await store.put(x(digest="04"), Entry(b"4"), ttl_s=60)
    assert evicted == [x(digest="02")]
    assert await store.get(x(digest="02")) is None
    assert all([await store.get(x(digest=d)) for d in ("01", "03", "04")])
    assert await store.get(x(tenant="other", digest="09")) is not None  # caps are per tenant
    stats = await store.stats()
    assert (stats["t"].entries, stats["t"].stores, stats["t"].evictions) == (3, 4, 1)
    assert stats["other"].entries == 1


async def test_invalidate_by_tenant_model_and_key_prefix(make_store):
    store = make_store()
    names = [x("a:b", "m*1", "abc1"), x("a:b", "m*1", "abd2"), x("a:b", "m2", "abc3"), x("c", "m*1", "abc4"),
             Name("a:b", "m*1", "s", "abc5")]
    for n in names:
        await store.put(n, Entry(b"v", b"\0" * 4, "q", "s") if n.kind == "s" else Entry(b"v"), ttl_s=60)
    removed = await store.invalidate(Selector(tenant="a:b", model="m*1", prefix="abc"))
    assert sorted(removed, key=lambda n: n.digest) == [names[0], names[4]]
    assert await store.get(names[1]) is not None
    assert sorted(n.digest for n in await store.invalidate(Selector(model="m*1"))) == ["abc4", "abd2"]
    assert await store.invalidate(Selector(tenant="a")) == []  # no prefix match across tenants
    assert [n.digest for n in await store.invalidate(Selector(tenant="a:b"))] == ["abc3"]
    assert (await store.stats("a:b"))["a:b"].entries == 0


async def test_counters_add_up(make_store):
    store = make_store()
    await store.count("t", "hits", 2)
    await store.count("t", "semantic_hits")
    await store.count("t", "misses", 5)
    s = (await store.stats("t"))["t"]
    assert (s.hits, s.semantic_hits, s.misses) == (2, 1, 5)


async def test_watch_semantic_says_when_it_listens_then_announces_new_entries(make_store):
    store = make_store()
    watch = store.watch_semantic()
    assert await anext(watch) is None
    sem = Name("t", "m", "s", "dd")
    await store.put(sem, Entry(b"a", b"\0" * 4, "q", "s"), ttl_s=60)
    await store.put(x(), Entry(b"exact entries are not announced"), ttl_s=60)
    if store.backend == "memory":  # one process: nothing to announce
        with pytest.raises(StopAsyncIteration):
            await anext(watch)
    else:
        announced = await asyncio.wait_for(anext(watch), 5)
        assert announced.name == sem and announced.entry.text == "q"
    await watch.aclose()

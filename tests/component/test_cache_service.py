"""The cache service in process over real gRPC, on a real redis-server, with the real
MiniLM: hits shared by two cache instances and kept across a restart, no hit across
tenants or system prompts, live config read per request, fail-open when Redis stops."""

import asyncio
import threading
import time
import uuid

import grpc
import pytest

from llmesh.cache.app import CacheApp
from llmesh.cache.config import CacheSettings
from llmesh.liveconfig.schema import MeshConfig
from llmesh.platform import standalone_platform
from llmesh.rpc.channels import mesh_channel
from llmesh.testing import RedisServer, wait_until_async
from llmesh.v1 import cache_pb2, cache_pb2_grpc, common_pb2

SEMANTIC = MeshConfig.model_validate({"cache": {"mode": "semantic", "semantic_threshold": 0.8}})


def query(text: str, tenant: str = "acme", system: str | None = "You are terse.", model: str = "m"):
    messages = ([common_pb2.ChatMessage(role="system", content=system)] if system else []) + [
        common_pb2.ChatMessage(role="user", content=text)]
    return cache_pb2.CacheQuery(tenant=tenant, model=model, chat=cache_pb2.CachedChat(messages=messages),
                                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=32))


def answer(text: str) -> cache_pb2.CachedResponse:
    return cache_pb2.CachedResponse(text=text, finish_reason=common_pb2.FINISH_REASON_STOP,
                                    usage=common_pb2.Usage(prompt_tokens=9, completion_tokens=3))


class Running:
    def __init__(self, app: CacheApp):
        self.app = app
        self.channel = mesh_channel(app.advertise_address, "cache")
        self.stub = cache_pb2_grpc.CacheStub(self.channel)
        self.stopped = False

    def config(self, config: MeshConfig) -> None:
        self.app_platform.config.current = config

    async def lookup(self, q) -> cache_pb2.LookupResponse:
        return await self.stub.Lookup(cache_pb2.LookupRequest(query=q), timeout=5)

    async def store(self, q, text: str) -> bool:
        return (await self.stub.Store(cache_pb2.StoreRequest(query=q, response=answer(text)), timeout=10)).stored

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            await self.channel.close()
            await self.app.stop(1)


class CacheApps:
    """Cache services started in process on free ports, over one fresh namespace of the Redis at
    ``redis_url`` (``defaults``: CacheSettings fields for each); ``stop`` ends every one."""

    def __init__(self, redis_url: str, minilm_dir, **defaults):
        self._namespace = f"test:{uuid.uuid4().hex}"
        self._redis_url, self._minilm_dir = redis_url, minilm_dir
        # a generous store budget: this machine is shared, and a call over budget is (rightly) a miss
        self._defaults = {"backend": "redis", "store_budget_s": 1.0, **defaults}
        self._running: list[Running] = []

    async def start(self, config: MeshConfig = SEMANTIC, url: str | None = None, **overrides) -> Running:
        platform = standalone_platform("cache")
        platform.config.current = config
        settings = CacheSettings(port=0, redis_url=url or self._redis_url, namespace=self._namespace,
                                 embed_model_dir=self._minilm_dir, **{**self._defaults, **overrides})
        app = CacheApp(settings, platform)
        await app.start()
        r = Running(app)
        r.app_platform = platform
        self._running.append(r)
        return r

    async def stop(self) -> None:
        for r in self._running:
            await r.stop()


@pytest.fixture
async def start(redis_server, minilm_dir):
    apps = CacheApps(redis_server.url, minilm_dir)
    yield apps.start
    await apps.stop()


async def _rebuilt(r: Running, n: int) -> None:
    deadline = time.monotonic() + 10
    while r.app.cache.semantic_indexed < n and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def test_exact_and_semantic_hits_are_shared_and_survive_a_restart(start):
    a, b = await start(), await start()
    try:
        assert await a.store(query("How do I reset my password?"), "Use the reset link.")
        exact = await b.lookup(query("How do I reset my password?"))
        assert exact.hit and exact.kind == cache_pb2.HIT_KIND_EXACT and exact.response.text == "Use the reset link."
        await _rebuilt(b, 1)  # b heard of a's semantic entry as it was stored
        shared = await b.lookup(query("How can I reset my password?"))
        assert shared.hit and shared.kind == cache_pb2.HIT_KIND_SEMANTIC
        await b.stop()  # a restart indexes what Redis holds
        c = await start()
        await _rebuilt(c, 1)
        semantic = await c.lookup(query("How can I reset my password?"))
        assert semantic.hit and semantic.kind == cache_pb2.HIT_KIND_SEMANTIC
        assert semantic.response.text == "Use the reset link." and 0.8 <= semantic.similarity < 1
        assert semantic.key and len(semantic.key) == 64
        assert c.app.metrics.lookups.labels("hit_semantic")._value.get() == 1
        await c.stop()
    finally:
        await a.stop()


async def test_no_hit_across_tenants_system_prompts_or_near_misses(start):
    a = await start()
    try:
        assert await a.store(query("How do I reset my password?"), "secret answer")
        for q in (query("How do I reset my password?", tenant="globex"),
                  query("How can I reset my password?", tenant="globex"),
                  query("How do I reset my password?", system="You are a pirate."),
                  query("How can I reset my password?", system=None),
                  query("How do I reset my password?", model="other"),
                  query("How do I not reset my password?")):
            assert not (await a.lookup(q)).hit, q
        refused = a.app.metrics.guard_refusals.labels("negation")._value.get()
        assert refused == 1
    finally:
        await a.stop()


async def test_live_config_applies_on_the_next_request(start):
    a = await start(MeshConfig())  # exact only
    try:
        await a.store(query("How do I reset my password?"), "x")
        assert not (await a.lookup(query("How can I reset my password?"))).hit
        a.config(SEMANTIC)  # semantic from now; stored entries get an embedding from now on
        await a.store(query("How do I reset my password?"), "x")
        assert (await a.lookup(query("How can I reset my password?"))).hit
        a.config(MeshConfig.model_validate({"cache": {"mode": "semantic", "tenants": {"acme": {"enabled": False}}}}))
        assert not (await a.lookup(query("How do I reset my password?"))).hit
        assert not await a.store(query("Another question?"), "y")
        a.config(MeshConfig.model_validate({"cache": {"mode": "semantic", "semantic_threshold": 0.999}}))
        assert not (await a.lookup(query("How can I reset my password?"))).hit
        sampled = query("Pick a number")
        sampled.sampling.temperature = 0.9
        assert not await a.store(sampled, "7")  # sampling: not cached unless the tenant opts in
        a.config(MeshConfig.model_validate({"cache": {"tenants": {"acme": {"cache_sampled": True}}}}))
        assert await a.store(sampled, "7") and (await a.lookup(sampled)).hit
    finally:
        await a.stop()


async def test_invalidate_and_stats_over_grpc(start):
    a = await start()
    try:
        await a.store(query("How do I reset my password?"), "x")
        await a.store(query("What is the capital of France?", tenant="globex"), "Paris")
        hit = await a.lookup(query("How do I reset my password?"))
        await a.lookup(query("Unknown question?"))
        stats = await a.stub.Stats(cache_pb2.StatsRequest(), timeout=5)
        by = {t.tenant: t for t in stats.tenants}
        assert stats.backend == "redis" and stats.backend_available and stats.semantic_indexed == 2
        assert (by["acme"].entries, by["acme"].hits, by["acme"].misses, by["acme"].stores) == (2, 1, 1, 2)
        removed = await a.stub.Invalidate(cache_pb2.InvalidateRequest(tenant="acme", key_prefix=hit.key[:8]),
                                          timeout=5)
        assert removed.removed == 2  # the exact entry and its semantic twin share the key
        assert not (await a.lookup(query("How do I reset my password?"))).hit
        assert (await a.stub.Invalidate(cache_pb2.InvalidateRequest(model="m"), timeout=5)).removed == 2
        assert (await a.stub.Stats(cache_pb2.StatsRequest(), timeout=5)).semantic_indexed == 0
        for bad in (cache_pb2.InvalidateRequest(), cache_pb2.InvalidateRequest(key_prefix="XYZ")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await a.stub.Invalidate(bad, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await a.stop()


async def test_fails_open_when_redis_stops_and_recovers_when_it_returns(start, tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    a = await start(url=server.url, store_pause_s=0.2, store_budget_s=0.2)
    try:
        await a.store(query("How do I reset my password?"), "x")
        assert (await a.lookup(query("How do I reset my password?"))).hit
        server.stop()
        for _ in range(5):
            started = time.perf_counter()
            assert not (await a.lookup(query("How can I reset my password?"))).hit
            assert time.perf_counter() - started < 0.5
        assert not await a.store(query("New question?"), "y")
        stats_errors = a.app.metrics.store_errors.labels("get")._value.get()
        assert stats_errors >= 1
        server.start()  # same port; nothing persisted
        await asyncio.sleep(0.3)
        deadline = time.monotonic() + 10
        back = False  # a call over its budget while the store reconnects pauses it again: retry till both work
        while not back and time.monotonic() < deadline:
            back = await a.store(query("Back again?"), "z") and (await a.lookup(query("Back again?"))).hit
            await asyncio.sleep(0.1)
        assert back
        assert (await a.lookup(query("Back again?"))).hit
    finally:
        await a.stop()
        server.stop()


async def test_a_looser_threshold_asked_for_under_load_is_honoured_and_marked_and_has_a_floor(start):
    """Degradation's cache policy: a Lookup with min_similarity may hit below the configured
    threshold (marked ``loosened``), never below the cache's floor, and changes nothing above it."""
    strict = MeshConfig.model_validate({"cache": {"mode": "semantic", "semantic_threshold": 0.95}})
    a = await start(strict)
    assert await a.store(query("How do I reset my password?"), "Use the reset link.")
    steps = query("What are the steps to reset my password?")  # MiniLM's cosine to the stored one: ~0.945
    assert not (await a.lookup(steps)).hit

    async def loose(q, at: float) -> cache_pb2.LookupResponse:
        return await a.stub.Lookup(cache_pb2.LookupRequest(query=q, min_similarity=at), timeout=5)

    found = await loose(steps, 0.9)
    assert found.hit and found.loosened and 0.9 <= found.similarity < 0.95
    assert found.response.text == "Use the reset link."
    assert not (await loose(query("Password reset?"), 0.9)).hit  # ~0.84: under the looser threshold too
    assert not (await loose(query("How do I bake bread?"), 0.1)).hit  # ~0.2: the floor (0.5) holds
    usual = await loose(query("How can I reset my password?"), 0.9)  # ~0.99: a hit anyway
    assert usual.hit and not usual.loosened
    exact = await loose(query("How do I reset my password?"), 0.9)
    assert exact.hit and exact.kind == cache_pb2.HIT_KIND_EXACT and not exact.loosened


async def test_a_lookup_its_caller_gave_up_on_finishes_counts_as_late_and_leaves_its_embedding(start, monkeypatch):
    """A lookup over the caller's deadline is not lost work: it ends on the cache, is counted as a
    late semantic hit (an answer the gateway's budget lost), not as a hit the caller got, and the store
    that follows the engine's answer takes the embedding from the memo instead of embedding again."""
    r = await start()
    try:
        assert await r.store(query("How do I reset my password?"), "Use the reset link.")
        minilm = r.app.semantic.embedder
        encode, asked = minilm.encode, []

        def slow(text: str):
            asked.append(text)
            time.sleep(0.3)  # an embedder on a CPU the engines keep busy
            return encode(text)

        monkeypatch.setattr(minilm, "encode", slow)
        paraphrase = query("How can I reset my password?")
        with pytest.raises(grpc.aio.AioRpcError) as over:
            await r.stub.Lookup(cache_pb2.LookupRequest(query=paraphrase), timeout=0.05)
        assert over.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        late = r.app.metrics.late_lookups.labels("hit_semantic")
        deadline = time.monotonic() + 5
        while late._value.get() < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert late._value.get() == 1
        assert r.app.metrics.lookups.labels("hit_semantic")._value.get() == 0
        assert await r.store(paraphrase, "Use the reset link.")
        assert asked == ["How can I reset my password?"]  # the store's embedding came from the memo
        deadline = time.monotonic() + 5  # the tenant's counters are written off the request path
        while (tenant := (await r.stub.Stats(cache_pb2.StatsRequest(tenant="acme"), timeout=5)).tenants[0]).misses < 1:
            assert time.monotonic() < deadline, tenant
            await asyncio.sleep(0.05)
        assert tenant.misses == 1 and tenant.semantic_hits == 0 and tenant.hits == 0
    finally:
        await r.stop()


async def test_the_cache_embeds_on_one_blas_thread(start):
    """Lookups embed side by side on worker threads; BLAS's own threads on top of them made a lookup
    several times slower on a busy CPU (the figures at EMBED_BLAS_THREADS)."""
    from threadpoolctl import threadpool_info

    r = await start()
    try:
        blas = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]
        assert blas and set(blas) == {1}
        assert (await r.lookup(query("How do I reset my password?"))).hit is False  # and it still embeds
    finally:
        await r.stop()


async def test_late_lookups_past_late_max_are_shed(start, monkeypatch):
    """An overloaded cache does not pile up work nobody awaits: past LATE_MAX late lookups running,
    the next one a caller gives up on is cancelled and counted as dropped."""
    from llmesh.cache import responses

    monkeypatch.setattr(responses, "LATE_MAX", 1)
    r = await start()
    gate = threading.Event()
    try:
        minilm = r.app.semantic.embedder
        encode = minilm.encode

        def held(text: str):  # every embedding waits for the gate: the first lookup stays late
            gate.wait(10)
            return encode(text)

        monkeypatch.setattr(minilm, "encode", held)
        late = r.app.metrics.late_lookups

        async def given_up(q: str) -> None:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await r.stub.Lookup(cache_pb2.LookupRequest(query=query(q)), timeout=0.3)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        await given_up("How can I reset my password?")
        assert await wait_until_async(lambda: r.app.cache._late == 1)  # it runs on, late
        await given_up("How can I change my email address?")  # LATE_MAX late ones running: this one is shed
        assert await wait_until_async(lambda: late.labels("dropped")._value.get() == 1)
        gate.set()
        assert await wait_until_async(lambda: late.labels("miss")._value.get() == 1)  # the late one finished: a miss
        assert r.app.cache._late == 0 and late.labels("dropped")._value.get() == 1
        # neither was answered: the lookup latency histogram holds neither (it held both, timed to their cancels)
        assert r.app.metrics.latency._sum.get() == 0
        await r.stub.Lookup(cache_pb2.LookupRequest(query=query("How do I delete my account?")), timeout=10)
        assert r.app.metrics.latency._sum.get() > 0  # an answered one is
    finally:
        gate.set()
        await r.stop()

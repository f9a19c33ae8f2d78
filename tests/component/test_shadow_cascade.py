"""Shadow copies and the cascade in the gateway pipeline, against real (sim) engines
served in-process over gRPC, with the shadow records in a real Redis and in files.
(The cascade's decision on real confidences is tested end to end on llama.cpp:
tests/e2e/test_shadow_cascade.py; the sim's logprobs are all the same.)"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry

from llmesh.liveconfig.schema import MeshConfig
from llmesh.shadow import FileShadowStore, RedisShadowStore
from llmesh.types import Delta
from llmesh.gateway.context import Context
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.stages.cascade import CASCADE_HEADER, CONFIDENCE_HEADER, MODEL_HEADER, CascadeMetrics, CascadeStage
from llmesh.gateway.stages.route import RouteStage
from llmesh.gateway.stages.shadow import ShadowMetrics, ShadowStage
from llmesh.gateway.stages.validate import ValidateStage
from llmesh.gateway.upstream.engines import EngineClients
from llmesh.gateway.upstream.picking import EndpointPicker
from tests.component.helpers import Catalog, collect, completion_request

FAST, SLOW = "sim-fast", "sim-slow"


def request(model: str, rid: str = "r1", **sampling):
    return completion_request(model, f"hello there {rid}", request_id=rid, timeout_s=20, max_tokens=8, temperature=0,
                              **sampling)


@pytest.fixture
async def picker(engines):
    """sim-fast answers at 1 ms a token, sim-slow at 60 ms a token (8 tokens: ~0.5 s)."""
    p = EndpointPicker()
    p.replace_all([await engines(model, model, sim_decode_ms_per_token=ms) for model, ms in ((FAST, 1), (SLOW, 60))])
    return p


def shadow_mesh(picker, store, config: MeshConfig):
    registry = CollectorRegistry()
    shadow = ShadowStage(lambda: config, store, ShadowMetrics(registry))
    clients = EngineClients()
    pipeline = Pipeline(picker, clients, Catalog(FAST, SLOW), config=lambda: config,
                        stages=[ValidateStage(), RouteStage(Catalog(FAST, SLOW), lambda: config), shadow])
    return pipeline, shadow, clients, registry


async def test_shadow_copy_never_delays_the_primary_and_is_recorded(picker, tmp_path):
    config = MeshConfig.model_validate({"splits": {"assistant": {"targets": [{"model": FAST, "weight": 1}]}},
                                        "shadows": {"assistant": {"model": SLOW}}})
    store = FileShadowStore(tmp_path)
    pipeline, shadow, clients, registry = shadow_mesh(picker, store, config)
    try:
        started = time.monotonic()
        text, finish, *_ = await collect(pipeline, request("assistant"))
        primary_s = time.monotonic() - started
        assert text and finish.usage.completion_tokens == 8
        await pipeline.drain()  # stage finishes ran: the copy is under way, not done
        assert primary_s < 0.4, primary_s  # the copy alone takes ~0.5 s
        assert await store.read("assistant") == ([], 0)
        await shadow.close()
        (record,), drops = await store.read("assistant")
        assert drops == 0
        assert record.primary.model == FAST and record.shadow.model == SLOW
        assert record.primary.status == record.shadow.status == "ok"
        assert record.shadow.latency_ms > 400 > record.primary.latency_ms
        assert record.primary.completion_tokens == record.shadow.completion_tokens == 8
        assert record.primary.prompt_tokens == record.shadow.prompt_tokens > 0
        assert 0 <= record.similarity <= 1 and record.primary.chars == len(text)
        # no text kept: the record's JSON holds neither the prompt nor the answer
        raw = next(tmp_path.glob("*.jsonl")).read_text()
        assert "hello there" not in raw and text not in raw
        assert registry.get_sample_value("llmesh_shadow_copies_total", {"alias": "assistant",
                                                                        "outcome": "recorded"}) == 1
        # a name without a shadow section is not copied
        await collect(pipeline, request(FAST, rid="plain"))
        await pipeline.drain()
        await shadow.close()
        assert len((await store.read("assistant"))[0]) == 1 and (await store.read(FAST)) == ([], 0)
    finally:
        await clients.close()


async def test_copies_past_max_concurrency_are_dropped_and_counted_in_redis(picker, redis_server):
    config = MeshConfig.model_validate({"shadows": {FAST: {"model": SLOW, "max_concurrency": 2}}})
    client = redis.asyncio.from_url(redis_server.url)
    store = RedisShadowStore(client, prefix="test:shadow-drops")
    pipeline, shadow, clients, registry = shadow_mesh(picker, store, config)
    try:
        results = await asyncio.gather(*(collect(pipeline, request(FAST, rid=f"r{i}")) for i in range(8)))
        assert all(text for text, *_ in results)
        await pipeline.drain()
        dropped = registry.get_sample_value("llmesh_shadow_copies_total", {"alias": FAST, "outcome": "dropped"})
        for _ in range(40):  # drop counts reach the store within a second, no shutdown needed
            if (await store.read(FAST))[1] == dropped:
                break
            await asyncio.sleep(0.05)
        assert (await store.read(FAST))[1] == dropped
        await shadow.close()
        records, drops = await store.read(FAST)
        dropped = registry.get_sample_value("llmesh_shadow_copies_total", {"alias": FAST, "outcome": "dropped"})
        assert len(records) >= 2 and drops >= 1 and len(records) + drops == 8 and dropped == drops
        # a second store object (another gateway, the CLI) reads the same
        assert len((await RedisShadowStore(client, prefix="test:shadow-drops").read(FAST))[0]) == len(records)
    finally:
        await clients.close()
        await client.aclose()


def cascade_pipeline(picker, config: MeshConfig):
    registry = CollectorRegistry()
    clients = EngineClients()
    pipeline = Pipeline(picker, clients, Catalog(FAST, SLOW), config=lambda: config,
                        stages=[ValidateStage(), CascadeStage(lambda: config, CascadeMetrics(registry)),
                                RouteStage(Catalog(FAST, SLOW), lambda: config)])
    return pipeline, clients, registry


SIM_CONFIDENCE = -math.log(16)  # the sim's every token: uniform over its 16 words


@pytest.mark.parametrize("threshold, outcome", [(SIM_CONFIDENCE - 0.1, "accepted"),
                                                (SIM_CONFIDENCE + 0.1, "escalated")])
async def test_cascade_holds_the_cheap_answer_and_decides_on_its_confidence(picker, threshold, outcome):
    # cheap = slow here, so holding its answer is visible: nothing reaches the client for ~0.5 s
    config = MeshConfig.model_validate({
        "cascades": {"smart": {"cheap": SLOW, "strong": FAST, "min_confidence": threshold}},
        "prices": {SLOW: {"output_per_1k": 1.0}, FAST: {"output_per_1k": 10.0}}})
    pipeline, clients, registry = cascade_pipeline(picker, config)
    try:
        ctx = Context.of(request("smart"))
        text, finish, first_at, _ = await collect(pipeline, request("smart"), ctx)
        assert first_at > 0.4  # the first item came after the cheap answer was complete
        answered = SLOW if outcome == "accepted" else FAST
        direct, *_ = await collect(pipeline, request(answered))
        assert text == direct and finish.usage.completion_tokens == 8
        assert ctx.headers[CASCADE_HEADER] == outcome and ctx.headers[MODEL_HEADER] == answered
        assert float(ctx.headers[CONFIDENCE_HEADER]) == pytest.approx(SIM_CONFIDENCE, abs=1e-4)
        assert ctx.record.model == answered
        assert registry.get_sample_value("llmesh_cascade_requests_total", {"alias": "smart", "outcome": outcome}) == 1
        avoided = registry.get_sample_value("llmesh_cascade_cost_avoided_usd_total", {"alias": "smart"})
        wasted = registry.get_sample_value("llmesh_cascade_cost_wasted_usd_total", {"alias": "smart"})
        if outcome == "accepted":  # 8 tokens at 10 $/1k instead of 1 $/1k
            assert avoided == pytest.approx(8 * 9 / 1000) and not wasted
        else:
            assert not avoided and wasted == pytest.approx(8 / 1000)
    finally:
        await clients.close()


async def test_cascade_keeps_logprobs_only_when_asked(picker):
    config = MeshConfig.model_validate({
        "cascades": {"smart": {"cheap": FAST, "strong": SLOW, "min_confidence": SIM_CONFIDENCE - 0.1}}})
    pipeline, clients, _ = cascade_pipeline(picker, config)
    try:
        plain = [i for i in [x async for x in pipeline.run(request("smart"))] if isinstance(i, Delta)]
        assert plain and all(not d.logprobs for d in plain)
        asked = [i for i in [x async for x in pipeline.run(request("smart", logprobs=2))] if isinstance(i, Delta)]
        assert all(len(d.logprobs) == d.tokens and len(d.logprobs[0].top) == 2 for d in asked if d.tokens)
    finally:
        await clients.close()


async def test_cascade_escalates_when_the_cheap_model_cannot_answer(picker):
    config = MeshConfig.model_validate({
        "cascades": {"smart": {"cheap": FAST, "strong": SLOW, "min_confidence": -100}}})
    picker.mark_down(FAST, time.monotonic())
    pipeline, clients, registry = cascade_pipeline(picker, config)
    try:
        ctx = Context.of(request("smart"))
        text, finish, *_ = await collect(pipeline, request("smart"), ctx)
        assert text and ctx.headers[MODEL_HEADER] == SLOW and CONFIDENCE_HEADER not in ctx.headers
        assert registry.get_sample_value("llmesh_cascade_requests_total",
                                         {"alias": "smart", "outcome": "escalated"}) == 1
    finally:
        await clients.close()

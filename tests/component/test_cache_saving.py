"""A cache hit spends nothing and its saving shows in usage: the pipeline with its limits and
audit stages in front of a real engine (sim backend, in process over gRPC) and the real cache
service (in-process store, real MiniLM), usage kept on a real redis-server and read back as
``llmesh usage`` reads it (from Redis, and from the audit log), and the gateway's metrics."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry

from llmesh.audit import AuditLog
from llmesh.cli.governance import audit_usage_rows, usage_rows
from llmesh.discovery.base import fixed
from llmesh.liveconfig.schema import MeshConfig
from llmesh.platform import standalone_platform
from llmesh.cache.app import CacheApp
from llmesh.cache.config import CacheSettings
from llmesh.gateway.domain.limits_redis import RedisLimiter
from llmesh.gateway.domain.tokens import TokenCounter
from llmesh.gateway.domain.prompt_tokens import NoTokens
from llmesh.gateway.metrics import GatewayMetrics
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.stages.audit import AuditStage
from llmesh.gateway.stages.limits import LimitStage
from llmesh.gateway.stages.route import RouteStage
from llmesh.gateway.stages.validate import ValidateStage
from llmesh.gateway.upstream.cache import CacheClient
from llmesh.gateway.upstream.engines import EngineClients
from llmesh.gateway.upstream.picking import EndpointPicker
from tests.component.helpers import Catalog, collect, completion_request, free_port

MODEL = "sim-small"
PRICE = {"input_per_1k": 2.0, "output_per_1k": 6.0}


@pytest.fixture
async def world(tmp_path, redis_server, minilm_dir, engines):
    engine = await engines("e", MODEL, sim_output_tokens=12)
    cache_platform = standalone_platform("cache")
    cache_platform.config.current = MeshConfig.model_validate({"cache": {"mode": "semantic",
                                                                         "semantic_threshold": 0.8}})
    cache = CacheApp(CacheSettings(port=free_port(), embed_model_dir=minilm_dir, store_budget_s=1.0), cache_platform)
    await cache.start()
    picker = EndpointPicker()
    picker.replace_all([engine])
    engine_clients = EngineClients()
    cache_client = CacheClient(fixed(cache.advertise_address), budget_s=2.0)
    config = MeshConfig.model_validate({"prices": {MODEL: PRICE}})
    current = lambda: config  # noqa: E731
    client = redis.asyncio.from_url(redis_server.url)
    audit = AuditLog(tmp_path / "audit.jsonl")
    metrics = GatewayMetrics(CollectorRegistry(), lambda model: model == MODEL)
    stages = [AuditStage(audit), ValidateStage(), RouteStage(Catalog(MODEL), current),
              LimitStage(RedisLimiter(client), current, TokenCounter(NoTokens()))]
    pipeline = Pipeline(picker, engine_clients, Catalog(MODEL), cache_client, config=current, stages=stages,
                        observe=metrics.observe)
    yield {"pipeline": pipeline, "redis": client, "metrics": metrics, "audit": audit, "cache": cache}
    await pipeline.drain()
    audit.close()
    await engine_clients.close()
    await cache_client.close()
    await cache.stop(0)
    await client.aclose()


async def ask(world, text: str, tenant: str):
    req = completion_request(MODEL, text, request_id=uuid.uuid4().hex, tenant=tenant, system="Be brief.",
                             temperature=0.0, max_tokens=64)
    answer = await collect(world["pipeline"], req)
    await world["pipeline"].drain()  # the miss's store and every stage's finish (usage) are done
    return answer


def saved(metrics: GatewayMetrics, metric: str, kind: str) -> float:
    return getattr(metrics, metric).labels(MODEL, kind)._value.get()


async def _semantic_indexed(world, n: int) -> None:
    for _ in range(200):
        if world["cache"].cache.semantic_indexed >= n:
            return
        await asyncio.sleep(0.05)


async def test_a_repeated_request_spends_nothing_and_shows_its_saving(world):
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    first = await ask(world, "How do I reset my password?", tenant)
    assert first.finish is not None
    spent = first.finish.usage
    assert spent.prompt_tokens > 0 and spent.completion_tokens > 0
    await _semantic_indexed(world, 1)
    again = await ask(world, "How do I reset my password?", tenant)  # exact
    paraphrase = await ask(world, "How can I reset my password?", tenant)  # semantic
    assert again.text == first.text == paraphrase.text
    assert again.finish.usage == spent  # the client still sees the answer's usage

    price = spent.prompt_tokens * PRICE["input_per_1k"] / 1000 + spent.completion_tokens * PRICE["output_per_1k"] / 1000
    days = [k.decode().rsplit(":", 1)[1] async for k in world["redis"].scan_iter("llmesh:usage:*")]
    rows = [r for r in await usage_rows(world["redis"], days) if r["tenant"] == tenant]
    assert len(rows) == 1
    row = rows[0]
    assert row["requests"] == 3 and row["cache_hits"] == 2
    # only the miss spent tokens and money; each hit saved what the first answer cost
    assert (row["prompt_tokens"], row["completion_tokens"]) == (spent.prompt_tokens, spent.completion_tokens)
    assert row["cost_usd"] == pytest.approx(price)
    assert (row["saved_prompt_tokens"], row["saved_completion_tokens"]) == (2 * spent.prompt_tokens,
                                                                            2 * spent.completion_tokens)
    assert row["saved_usd"] == pytest.approx(2 * price)

    world["audit"].flush()
    from_audit = [r for r in audit_usage_rows([world["audit"].path]) if r["tenant"] == tenant]
    assert from_audit == [row]  # a mesh without Redis shows the same from its audit log

    m = world["metrics"]
    assert saved(m, "cache_saved_tokens", "exact") == spent.prompt_tokens + spent.completion_tokens
    assert saved(m, "cache_saved_tokens", "semantic") == spent.prompt_tokens + spent.completion_tokens
    assert saved(m, "cache_saved_usd", "exact") == pytest.approx(price)
    assert saved(m, "cache_saved_usd", "semantic") == pytest.approx(price)

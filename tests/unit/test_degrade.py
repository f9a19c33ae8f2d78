"""Degradation under load: the policy choice (services/gateway/domain/degrade.py) on plain
inputs, the live config's rules, and the stage (services/gateway/stages/degrade.py) on a
measured load: what it rewrites, the header and the counts."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from llmesh.liveconfig.schema import Degradation, MeshConfig, Provider, SplitTarget, TrafficSplit
from llmesh.types import Priority, Prompt, Sampling
from llmesh.gateway.context import CompletionRequest, Context
from llmesh.gateway.domain.degrade import CACHE, MAX_TOKENS, VARIANT, Verdict, choose, load_of
from llmesh.gateway.stages.degrade import DEGRADED_HEADER, MODEL_HEADER, DegradeStage

BOTH = Degradation(saturation=0.9, max_tokens=32, variant="small")


def test_below_the_threshold_nothing_applies():
    assert choose(BOTH, "big", 0.89, 512, variant_known=True, variant_load=0.1) is None
    assert choose(BOTH, "big", None, 512, variant_known=True) is None  # no endpoint measured
    assert choose(None, "big", 5.0, 512) is None  # no rule for the model and class


def test_at_the_threshold_both_policies_apply():
    assert choose(BOTH, "big", 0.9, 512, variant_known=True, variant_load=0.2) == Verdict(
        (VARIANT, MAX_TOKENS), "small", 32)


def test_the_cap_sets_a_limit_on_a_request_without_one_and_leaves_a_smaller_one_alone():
    cap = Degradation(max_tokens=32)
    assert choose(cap, "big", 1.5, None) == Verdict((MAX_TOKENS,), "big", 32)
    assert choose(cap, "big", 1.5, 16) is None  # nothing to change: not marked as degraded
    assert choose(BOTH, "big", 1.5, 16, variant_known=True, variant_load=0.0) == Verdict((VARIANT,), "small", 16)


def test_a_variant_is_skipped_when_unknown_or_as_loaded():
    assert choose(BOTH, "big", 1.0, 512, variant_known=False) == Verdict((MAX_TOKENS,), "big", 32)
    assert choose(BOTH, "big", 1.0, 512, variant_known=True, variant_load=1.0) == Verdict((MAX_TOKENS,), "big", 32)
    only_variant = Degradation(variant="small")
    assert choose(only_variant, "big", 1.0, 512, variant_known=True, variant_load=1.4) is None
    # a provider's model has no measured load: it is taken
    assert choose(only_variant, "big", 1.0, 512, variant_known=True, variant_load=None) == Verdict(
        (VARIANT,), "small", 512)


def test_load_counts_busy_slots_and_the_gateways_queue():
    assert load_of(free=4, total=4, waiting=0) == 0.0
    assert load_of(free=0, total=4, waiting=2) == 1.5
    assert load_of(free=0, total=0, waiting=3) is None


def test_config_rules():
    with pytest.raises(ValidationError, match="sets max_tokens, variant, cache_similarity"):
        Degradation(saturation=0.5)
    with pytest.raises(ValidationError, match="another model"):
        MeshConfig(degradation={"big": {"standard": Degradation(variant="big")}})
    with pytest.raises(ValidationError, match="another model"):
        MeshConfig(splits={"alias": TrafficSplit(targets=[SplitTarget(model="big", weight=1)])},
                   degradation={"big": {"batch": Degradation(variant="alias")}})
    with pytest.raises(ValidationError):
        MeshConfig(degradation={"big": {"urgent": {"max_tokens": 8}}})  # not a class


class Catalog:
    def __init__(self, *models: str):
        self.models = set(models)

    def known(self, model: str) -> bool:
        return model in self.models


class Counted:
    def __init__(self):
        self.counts: dict[tuple[str, str, str], int] = {}

    def degraded(self, model: str, klass: str, policy: str) -> None:
        key = (model, klass, policy)
        self.counts[key] = self.counts.get(key, 0) + 1


def _request(priority: Priority = Priority.NORMAL, max_tokens: int | None = 256) -> CompletionRequest:
    return CompletionRequest(request_id="r", tenant="t", model="big", prompt=Prompt(text="hello"),
                             sampling=Sampling(max_tokens=max_tokens), timeout_s=30.0, priority=priority)


def _stage(loads: dict[str, float], config: MeshConfig, metrics: Counted) -> DegradeStage:
    return DegradeStage(lambda: config, lambda model, embed: loads.get(model), Catalog("big", "small"), metrics)


CONFIG = MeshConfig(degradation={"big": {"batch": Degradation(saturation=1.0, max_tokens=8, variant="small"),
                                         "standard": Degradation(saturation=1.0, max_tokens=64)}})


def test_the_stage_rewrites_a_saturated_request_marks_and_counts_it():
    metrics = Counted()
    loads = {"big": 1.25, "small": 0.5}
    stage = _stage(loads, CONFIG, metrics)
    ctx = Context.of(_request(Priority.LOW))
    asyncio.run(stage.admit(ctx))
    assert (ctx.req.model, ctx.req.sampling.max_tokens) == ("small", 8)
    assert ctx.headers == {DEGRADED_HEADER: "variant,max_tokens", MODEL_HEADER: "small"}
    assert ctx.record.model == "small"
    assert ctx.policy.fallbacks == ["big"]  # the variant's policy, the model itself as its last fallback
    ctx = Context.of(_request(Priority.NORMAL))
    asyncio.run(stage.admit(ctx))
    assert (ctx.req.model, ctx.req.sampling.max_tokens) == ("big", 64)  # the standard class's rule: a cap only
    assert ctx.headers == {DEGRADED_HEADER: "max_tokens"}
    assert metrics.counts == {("big", "batch", "variant"): 1, ("big", "batch", "max_tokens"): 1,
                              ("big", "standard", "max_tokens"): 1}


def test_the_stage_leaves_alone_what_no_rule_or_no_load_calls_for():
    metrics = Counted()
    loads = {"big": 0.75}
    stage = _stage(loads, CONFIG, metrics)
    for req in (_request(Priority.LOW), _request(Priority.HIGH)):
        ctx = Context.of(req)
        asyncio.run(stage.admit(ctx))
        assert ctx.req is req and not ctx.headers
    loads["big"] = 3.0
    ctx = Context.of(_request(Priority.HIGH))  # critical: no rule
    asyncio.run(stage.admit(ctx))
    assert ctx.req.sampling.max_tokens == 256 and not ctx.headers
    assert metrics.counts == {}


def test_the_choices_of_one_request_share_one_verdict():
    metrics = Counted()
    loads = {"big": 1.0, "small": 0.0}
    stage = _stage(loads, CONFIG, metrics)
    shared: dict = {}
    first = Context.of(_request(Priority.LOW), shared)
    asyncio.run(stage.admit(first))
    loads["big"] = 0.0  # the load changed between the two choices: the second still gets the first's verdict
    second = Context.of(_request(Priority.LOW), shared)
    asyncio.run(stage.admit(second))
    assert first.req.model == second.req.model == "small"
    assert second.headers[DEGRADED_HEADER] == "variant,max_tokens"
    assert metrics.counts == {("big", "batch", "variant"): 1, ("big", "batch", "max_tokens"): 1}  # one request


def test_a_variant_with_no_endpoint_now_is_skipped_unless_a_provider_serves_it():
    metrics = Counted()
    loads = {"big": 1.0}  # "small" has no endpoint (scaled to zero): its first request would wait
    ctx = Context.of(_request(Priority.LOW))
    asyncio.run(_stage(loads, CONFIG, metrics).admit(ctx))
    assert (ctx.req.model, ctx.headers[DEGRADED_HEADER]) == ("big", "max_tokens")
    provided = MeshConfig(degradation=CONFIG.degradation, providers={"p": Provider(
        base_url="https://api.example.com/v1", models={"small": "gpt-small"})})
    ctx = Context.of(_request(Priority.LOW))
    asyncio.run(_stage(loads, provided, metrics).admit(ctx))
    assert (ctx.req.model, ctx.headers[DEGRADED_HEADER]) == ("small", "variant,max_tokens")


def test_a_looser_cache_threshold_rides_with_the_verdict_and_is_named_only_when_a_hit_needed_it():
    loose = Degradation(saturation=1.0, cache_similarity=0.7)
    assert choose(loose, "big", 0.9, 512) is None  # below saturation
    assert choose(loose, "big", 1.0, 512) == Verdict((), "big", 512, 0.7)  # nothing applied yet
    metrics = Counted()
    config = MeshConfig(degradation={"big": {"standard": Degradation(max_tokens=64, cache_similarity=0.7)}})
    stage = _stage({"big": 1.5}, config, metrics)
    ctx = Context.of(_request(Priority.NORMAL))
    asyncio.run(stage.admit(ctx))
    assert ctx.loose_cache is not None and ctx.loose_cache.min_similarity == 0.7
    assert ctx.headers == {DEGRADED_HEADER: "max_tokens"}  # the cache has not answered (yet)
    ctx.loose_cache.served()  # the cache stage: a hit below the cache's own threshold served it
    assert ctx.headers == {DEGRADED_HEADER: "max_tokens,cache"}
    only = _stage({"big": 1.5}, MeshConfig(degradation={"big": {"standard": loose}}), metrics)
    ctx = Context.of(_request(Priority.NORMAL))
    asyncio.run(only.admit(ctx))
    assert ctx.headers == {} and ctx.loose_cache is not None
    ctx.loose_cache.served()
    assert ctx.headers == {DEGRADED_HEADER: CACHE}
    assert metrics.counts == {("big", "standard", "max_tokens"): 1, ("big", "standard", "cache"): 2}
    with pytest.raises(ValidationError):
        Degradation(cache_similarity=0.3)  # below what MiniLM's cosine can vouch for

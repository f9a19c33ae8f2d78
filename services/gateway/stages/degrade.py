"""Degradation under load (the live config's ``degradation``, per model and class): once the
routed model is saturated, a request of a class with a rule gets a capped ``max_tokens``
and/or a smaller variant model instead of a wait or a refusal (the choice:
domain/degrade.py). It runs right after routing, so everything after it (context length,
limits and budgets, guards, flow control's queue, the cache's key, the endpoint) sees the
degraded request: the variant's queue and slots, its price in usage. The variant's policy applies,
with the model asked for last among its fallbacks: a degraded request is never refused where the
model would have answered it (a prompt longer than the variant's context, no healthy variant).

The response names the policies applied, comma-separated, in ``x-llmesh-degraded`` (an HTTP
header; gRPC initial and trailing metadata) and the variant in ``x-llmesh-model``; the
access record's model is the variant's. ``llmesh_degraded_requests_total{model,class,policy}``
counts each policy applied (model: the one asked for, as routed). The choices of one
request (n > 1) share one verdict. Embeddings are never degraded.

A rule's ``cache_similarity`` is handed to the cache stage (``Context.loose_cache``): its
lookup asks the cache service for that looser semantic threshold (guards and verifier still
apply), and only a hit that needed it marks and counts the ``cache`` policy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Protocol, cast

from llmesh.liveconfig.schema import ClassName, Degradation, MeshConfig, ModelPolicy
from llmesh.gateway.context import Catalog, Context, LooseCache
from llmesh.gateway.domain.degrade import CACHE, VARIANT, Verdict, choose
from llmesh.gateway.domain.fairness import CLASS_OF, CLASSES
from llmesh.gateway.stages.base import Stage

DEGRADED_HEADER = "x-llmesh-degraded"
MODEL_HEADER = "x-llmesh-model"
_SHARED = object()  # the key of a request's verdict in ``Context.shared`` (its choices share it)

Load = Callable[[str, bool], float | None]  # (model, embed) -> its load, None: not measured


class DegradeObserver(Protocol):
    def degraded(self, model: str, klass: str, policy: str) -> None: ...


class DegradeStage(Stage):
    def __init__(self, config: Callable[[], MeshConfig], load: Load, catalog: Catalog, metrics: DegradeObserver):
        self._config = config
        self._load = load
        self._catalog = catalog
        self._metrics = metrics
        self._policies: tuple[MeshConfig, dict[tuple[str, str], ModelPolicy]] | None = None  # per config

    async def admit(self, ctx: Context) -> None:
        config = self._config()
        if not config.degradation or ctx.req.embeds:
            return
        rules = config.degradation.get(ctx.req.model)
        if rules is None:
            return
        klass = CLASSES[CLASS_OF.get(ctx.req.priority, 1)]
        shared = ctx.shared
        fresh = shared is None or _SHARED not in shared
        if fresh:
            verdict = self._verdict(config, ctx, rules.get(cast(ClassName, klass)))
            if shared is not None:
                shared[_SHARED] = verdict
        else:
            verdict = shared[_SHARED]  # type: ignore[index]
        if verdict is not None:
            model = ctx.req.model
            if fresh:  # counted once per request, not per choice
                for policy in verdict.policies:
                    self._metrics.degraded(model, klass, policy)
            self._apply(config, ctx, verdict)
            if verdict.cache_similarity is not None:
                ctx.loose_cache = LooseCache(verdict.cache_similarity, partial(self._loose_hit, ctx, model, klass))

    def _verdict(self, config: MeshConfig, ctx: Context, rule: Degradation | None) -> Verdict | None:
        req = ctx.req
        if rule is None:
            return None
        load = self._load(req.model, False)
        usable, variant_load = False, None
        if rule.variant is not None and load is not None and load >= rule.saturation:
            # a provider's model (no load measured), or one with endpoints now: not one scaled to zero,
            # whose first request would wait for a replica to start
            usable = config.provider_for(rule.variant) is not None
            if not usable and self._catalog.known(rule.variant):
                variant_load = self._load(rule.variant, False)
                usable = variant_load is not None
        return choose(rule, req.model, load, req.sampling.max_tokens, usable, variant_load)

    def _apply(self, config: MeshConfig, ctx: Context, verdict: Verdict) -> None:
        req = ctx.req
        sampling = req.sampling
        if verdict.max_tokens != sampling.max_tokens:
            sampling = replace(sampling, max_tokens=verdict.max_tokens)
        ctx.req = replace(req, model=verdict.model, sampling=sampling)
        if VARIANT in verdict.policies:
            ctx.policy = self._variant_policy(config, verdict.model, req.model)
            ctx.record.model = verdict.model
            ctx.headers[MODEL_HEADER] = verdict.model
        if verdict.policies:
            ctx.headers[DEGRADED_HEADER] = ",".join(verdict.policies)

    def _loose_hit(self, ctx: Context, model: str, klass: str) -> None:
        """A semantic hit that only the rule's looser threshold allowed served ``ctx``."""
        applied = ctx.headers.get(DEGRADED_HEADER)
        ctx.headers[DEGRADED_HEADER] = f"{applied},{CACHE}" if applied else CACHE
        self._metrics.degraded(model, klass, CACHE)

    def _variant_policy(self, config: MeshConfig, variant: str, model: str) -> ModelPolicy:
        """The variant's routing and retries, with ``model`` last among its fallbacks (a prompt the
        variant cannot fit); made once per config, not per request (a saturated gateway's CPU)."""
        if self._policies is None or self._policies[0] is not config:
            self._policies = config, {}
        made = self._policies[1]
        policy = made.get((variant, model))
        if policy is None:
            policy = config.policy(variant)
            if model not in policy.fallbacks:
                policy = policy.model_copy(update={"fallbacks": [*policy.fallbacks, model]})
            made[(variant, model)] = policy
        return policy

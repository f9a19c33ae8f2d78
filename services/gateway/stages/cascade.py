"""Confidence cascade: an alias is answered by its cheap model first; when the cheap
answer's confidence (the mean log probability of its tokens, which the engines
report) is under the alias's ``min_confidence``, the answer is thrown away and the
strong model answers. The cheap answer is held in full before anything reaches the
client, so a stream starts only once the decision is made and never mixes models.

An answer with no tokens has no confidence and is escalated; so is a request whose
cheap model (and its fallbacks) could not answer at all. The response says who
answered (``x-llmesh-model``), what was decided (``x-llmesh-cascade``) and the
confidence (``x-llmesh-confidence``); metrics count outcomes and money: avoided (the
strong model's price for the tokens the cheap one answered with, minus the cheap
price) and spent on escalated requests (the cheap model's cost, thrown away).
Usage reported to the client and charged is that of the answer it got. The strong
model gets the request as the cheap one did (the prompt and generation defaults the
cheap model's policy filled in), with its own routing, retries and fallbacks. The
stage answers through a wrap around the upstream (``Context.wrap``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter

from llmesh.errors import Overloaded, Unavailable
from llmesh.liveconfig.schema import Cascade, MeshConfig, Price
from llmesh.types import Delta, Finish, Usage
from llmesh.gateway.context import CompletionRequest, Context, Items, Upstream
from llmesh.gateway.stages.base import Stage

MODEL_HEADER = "x-llmesh-model"
CASCADE_HEADER = "x-llmesh-cascade"
CONFIDENCE_HEADER = "x-llmesh-confidence"


class CascadeMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("llmesh_cascade_requests", "Cascade answers by alias and outcome (accepted: the "
                                "cheap model's; escalated: the strong model's).", ("alias", "outcome"),
                                registry=registry)
        self.avoided = Counter("llmesh_cascade_cost_avoided_usd", "What accepted cheap answers would have cost "
                               "more on the strong model, at the configured prices.", ("alias",), registry=registry)
        self.wasted = Counter("llmesh_cascade_cost_wasted_usd", "What the cheap answers thrown away on escalation "
                              "cost. Saved = avoided - wasted.", ("alias",), registry=registry)


def cost_usd(price: Price | None, usage: Usage) -> float:
    if price is None:
        return 0.0
    return (usage.prompt_tokens * price.input_per_1k + usage.completion_tokens * price.output_per_1k) / 1000


def mean_logprob(logprobs: list[float]) -> float | None:
    return math.fsum(logprobs) / len(logprobs) if logprobs else None


class CascadeStage(Stage):
    """Runs before routing: a cascade alias becomes its cheap model, and the stage
    answers the request through a wrap around the upstream."""

    def __init__(self, config: Callable[[], MeshConfig], metrics: CascadeMetrics):
        self._config = config
        self._metrics = metrics

    async def admit(self, ctx: Context) -> None:
        config = self._config()
        cascade = config.cascades.get(ctx.req.model)
        if cascade is None or ctx.req.embeds:  # confidence is a generated answer's: no cascade of embeddings
            return
        req = ctx.req
        wanted = req.sampling.logprobs
        ctx.req = replace(req, model=cascade.cheap,
                          sampling=replace(req.sampling, logprobs=0 if wanted is None else wanted))
        ctx.wrap(_Answer(req.model, cascade, wanted, ctx, self._metrics,
                         config.prices.get(cascade.cheap), config.prices.get(cascade.strong)).run)


class _Answer:
    def __init__(self, alias: str, cascade: Cascade, wanted: int | None, ctx: Context, metrics: CascadeMetrics,
                 cheap_price: Price | None, strong_price: Price | None):
        self._alias = alias
        self._cascade = cascade
        self._wanted = wanted
        self._ctx = ctx
        self._metrics = metrics
        self._prices = cheap_price, strong_price

    async def run(self, req: CompletionRequest, upstream: Upstream) -> Items:
        held: list[Delta | Finish] = []
        logprobs: list[float] = []
        try:
            async with aclosing(upstream(req)) as items:
                async for item in items:
                    held.append(item)
                    if isinstance(item, Delta):
                        logprobs.extend(t.logprob for t in item.logprobs)
        except (Unavailable, Overloaded):
            held = []  # the cheap model (and its fallbacks) could not answer: the strong one may
        confidence = mean_logprob(logprobs) if held else None
        cheap_usage = held[-1].usage if held and isinstance(held[-1], Finish) else Usage()
        cheap_cost = cost_usd(self._prices[0], cheap_usage)
        accepted = confidence is not None and confidence >= self._cascade.min_confidence
        ctx, alias = self._ctx, self._alias
        answered = self._cascade.cheap if accepted else self._cascade.strong
        ctx.headers[MODEL_HEADER] = answered
        ctx.headers[CASCADE_HEADER] = "accepted" if accepted else "escalated"
        if confidence is not None:
            ctx.headers[CONFIDENCE_HEADER] = f"{confidence:.4f}"
        ctx.record.cascade = ctx.headers[CASCADE_HEADER]
        ctx.record.cascade_confidence = confidence
        self._metrics.requests.labels(alias, ctx.headers[CASCADE_HEADER]).inc()
        if accepted:
            self._metrics.avoided.labels(alias).inc(max(0.0, cost_usd(self._prices[1], cheap_usage) - cheap_cost))
            for item in held:
                if self._wanted is None and isinstance(item, Delta) and item.logprobs:
                    item = Delta(text=item.text, tokens=item.tokens)
                yield item
            return
        self._metrics.wasted.labels(alias).inc(cheap_cost)
        ctx.record.model = answered
        strong = replace(req, model=answered, sampling=replace(req.sampling, logprobs=self._wanted))
        async with aclosing(upstream(strong)) as items:
            async for item in items:
                yield item

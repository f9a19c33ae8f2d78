"""The limits stage: a tenant's request, token, concurrency and budget limits
from live config, admitted by a Limiter; OpenAI's ``x-ratelimit-*`` headers on
every answer, 429 with ``Retry-After`` on a refusal; usage and cost recorded
when the request ends."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from llmesh.errors import RateLimited
from llmesh.liveconfig.schema import Budget, MeshConfig
from llmesh.gateway.context import Context, Slot
from llmesh.gateway.domain.limits import Ask, Limiter, Outcome, Verdict
from llmesh.gateway.domain.quota import MESSAGES, REASONS, Periods, duration, micro_usd, ratelimit_headers
from llmesh.gateway.domain.tokens import TokenCounter
from llmesh.gateway.stages.base import Stage


class LimitStage(Stage):
    def __init__(self, limiter: Limiter, config: Callable[[], MeshConfig], counter: TokenCounter,
                 reserve_tokens: int = 512, lease_s: float = 600.0, wall: Callable[[], float] = time.time):
        self._limiter = limiter
        self._config = config
        self._counter = counter
        self._reserve = reserve_tokens
        self._lease_ms = int(lease_s * 1000)
        self._wall = wall
        self._periods = Periods()
        self._admitted: Slot[tuple[Ask, Verdict]] = Slot("limits")

    async def admit(self, ctx: Context) -> None:
        cfg, req = self._config(), ctx.req
        rl = cfg.rate_limit(req.tenant)
        budget = cfg.tenant(req.tenant).budget
        price = cfg.prices.get(req.model)
        now = self._wall()
        limited = rl is not None or budget is not None
        counted = limited and bool((rl and rl.tokens_per_minute) or budget)
        if not counted:
            input_tokens = 0
        elif req.inputs is not None:
            input_tokens = await self._counter.count_texts(req.model, req.inputs)
        else:
            ctx.tokens = self._counter.tokens(req.prompt, req.tools)
            input_tokens = await self._counter.count(req.model, ctx.tokens)
        output = 0 if req.embeds else req.sampling.max_tokens or self._reserve  # embeddings: prompt tokens only
        ask = Ask(tenant=req.tenant, rid=req.request_id, tokens=input_tokens + output if counted else 0,
                  rpm=(rl.requests_per_minute or 0) if rl else 0, tpm=(rl.tokens_per_minute or 0) if rl else 0,
                  concurrency=(rl.max_concurrency or 0) if rl else 0, lease_ms=self._lease_ms,
                  cost_micro=micro_usd(price, input_tokens, output) if budget else 0)
        if budget is not None:
            ident, end = self._periods(budget.period, now)
            ask = _with_budget(ask, budget, f"llmesh:budget:{{{req.tenant}}}:{ident}", max(1, int((end - now) * 1000)))
        verdict = await self._limiter.admit(ask, int(now * 1000)) if limited else Verdict(True)
        self._admitted.put(ctx, (ask, verdict))
        ctx.record.limits = verdict.where if limited else "none"
        headers = ratelimit_headers(rl, verdict)
        if not verdict.ok:
            retry_ms = max(verdict.retry_after_ms, 1)
            headers["retry-after"] = str(math.ceil(retry_ms / 1000))
            headers["retry-after-ms"] = str(retry_ms)
            limit = {"requests": rl and rl.requests_per_minute, "tokens": rl and rl.tokens_per_minute,
                     "concurrency": rl and rl.max_concurrency}.get(verdict.limit)
            message = MESSAGES[verdict.limit].format(limit=limit, need=ask.tokens, retry=duration(retry_ms),
                                                    period=budget.period if budget else "")
            raise RateLimited(message, REASONS[verdict.limit], headers)
        ctx.headers.update(headers)

    async def finish(self, ctx: Context) -> None:
        noted = self._admitted.get(ctx)
        if noted is None:
            return
        ask, verdict = noted
        if not verdict.ok:
            return
        r = ctx.record
        if r.status == "ok":
            prompt, completion = r.prompt_tokens, r.completion_tokens
        elif r.ttft_ms is not None:  # ended mid-answer: what it reserved is what it is charged
            prompt, completion = 0, ask.tokens
        else:
            await self._limiter.settle(ask, verdict, None)
            return
        price = self._config().prices.get(r.model)
        cost = micro_usd(price, prompt, completion)
        r.cost_usd = cost / 1e6
        day, _ = self._periods("day", self._wall())
        outcome = Outcome(r.model, day, prompt, completion, cost)
        if r.cache_kind is not None and r.status == "ok":  # a hit: what it did not spend (the cache stage's)
            outcome = replace(outcome, cache_hit=True, saved_prompt_tokens=r.saved_prompt_tokens,
                              saved_completion_tokens=r.saved_completion_tokens,
                              saved_micro=round((r.saved_usd or 0.0) * 1e6))
        await self._limiter.settle(ask, verdict, outcome)


def _with_budget(ask: Ask, budget: Budget, key: str, left_ms: int) -> Ask:
    return replace(ask, budget_key=key, budget_tokens=budget.tokens or 0,
                   budget_micro=round((budget.usd or 0) * 1e6), budget_reset_ms=left_ms)

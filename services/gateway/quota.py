"""The limits stage: a tenant's request, token, concurrency and budget limits
from live config, admitted by a Limiter; OpenAI's ``x-ratelimit-*`` headers on
every answer, 429 with ``Retry-After`` on a refusal; usage and cost recorded
when the request ends."""

from __future__ import annotations

import calendar
import math
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone

from llmesh.errors import RateLimited
from llmesh.liveconfig.schema import Budget, MeshConfig, Price, RateLimit
from llmesh.gateway.limits import Ask, Limiter, Outcome, Verdict
from llmesh.gateway.pipeline import Context
from llmesh.gateway.tokens import TokenCounter

MESSAGES = {
    "requests": "Rate limit reached for requests per minute ({limit}). Retry after {retry}.",
    "tokens": "Rate limit reached for tokens per minute ({limit}); this request needs {need}. Retry after {retry}.",
    "concurrency": "Too many concurrent requests for this tenant (limit {limit}). Retry after {retry}.",
    "budget": "This tenant's {period} budget is spent. It renews in {retry}.",
}
REASONS = {"requests": "rate_limit_exceeded", "tokens": "rate_limit_exceeded",
           "concurrency": "rate_limit_exceeded", "budget": "insufficient_quota"}


def micro_usd(price: Price | None, input_tokens: int, output_tokens: int) -> int:
    if price is None:
        return 0
    return round((input_tokens * price.input_per_1k + output_tokens * price.output_per_1k) * 1000)


def period_bounds(kind: str, now: float) -> tuple[str, float]:
    """The UTC day or month holding ``now``: its id and when it ends."""
    t = datetime.fromtimestamp(now, tz=timezone.utc)
    if kind == "day":
        return t.strftime("%Y-%m-%d"), datetime(t.year, t.month, t.day, tzinfo=timezone.utc).timestamp() + 86400
    days = calendar.monthrange(t.year, t.month)[1]
    return t.strftime("%Y-%m"), datetime(t.year, t.month, 1, tzinfo=timezone.utc).timestamp() + days * 86400


class Periods:
    """period_bounds, worked out again only when a period ends (not per request)."""

    def __init__(self):
        self._current: dict[str, tuple[str, float]] = {}

    def __call__(self, kind: str, now: float) -> tuple[str, float]:
        hit = self._current.get(kind)
        if hit is None or now >= hit[1]:
            hit = self._current[kind] = period_bounds(kind, now)
        return hit


def duration(ms: int) -> str:
    """OpenAI's reset format: 20ms, 1s, 6m0s."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    s = math.ceil(ms / 1000)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


def ratelimit_headers(rl: RateLimit | None, v: Verdict) -> dict[str, str]:
    out: dict[str, str] = {}
    if rl is None:
        return out
    if rl.requests_per_minute:
        out["x-ratelimit-limit-requests"] = str(rl.requests_per_minute)
        out["x-ratelimit-remaining-requests"] = str(max(0, rl.requests_per_minute - v.requests_used))
        out["x-ratelimit-reset-requests"] = duration(v.requests_reset_ms)
    if rl.tokens_per_minute:
        out["x-ratelimit-limit-tokens"] = str(rl.tokens_per_minute)
        out["x-ratelimit-remaining-tokens"] = str(max(0, rl.tokens_per_minute - v.tokens_used))
        out["x-ratelimit-reset-tokens"] = duration(v.tokens_reset_ms)
    return out


class LimitStage:
    def __init__(self, limiter: Limiter, config: Callable[[], MeshConfig], counter: TokenCounter,
                 reserve_tokens: int = 512, lease_s: float = 600.0, wall: Callable[[], float] = time.time):
        self._limiter = limiter
        self._config = config
        self._counter = counter
        self._reserve = reserve_tokens
        self._lease_ms = int(lease_s * 1000)
        self._wall = wall
        self._periods = Periods()

    async def admit(self, ctx: Context) -> None:
        cfg, req = self._config(), ctx.req
        rl = cfg.rate_limit(req.tenant)
        budget = cfg.tenant(req.tenant).budget
        price = cfg.prices.get(req.model)
        now = self._wall()
        limited = rl is not None or budget is not None
        counted = limited and bool((rl and rl.tokens_per_minute) or budget)
        input_tokens = self._counter.count(req.model, req.prompt) if counted else 0
        output = req.sampling.max_tokens or self._reserve
        ask = Ask(tenant=req.tenant, rid=req.request_id, tokens=input_tokens + output if counted else 0,
                  rpm=(rl.requests_per_minute or 0) if rl else 0, tpm=(rl.tokens_per_minute or 0) if rl else 0,
                  concurrency=(rl.max_concurrency or 0) if rl else 0, lease_ms=self._lease_ms,
                  cost_micro=micro_usd(price, input_tokens, output) if budget else 0)
        if budget is not None:
            ident, end = self._periods(budget.period, now)
            ask = _with_budget(ask, budget, f"llmesh:budget:{{{req.tenant}}}:{ident}", max(1, int((end - now) * 1000)))
        verdict = await self._limiter.admit(ask, int(now * 1000)) if limited else Verdict(True)
        ctx.notes["limits"] = (ask, verdict)
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
        noted = ctx.notes.get("limits")
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
        cfg = self._config()
        cost = micro_usd(cfg.prices.get(r.model), prompt, completion)
        r.cost_usd = cost / 1e6
        day, _ = self._periods("day", self._wall())
        await self._limiter.settle(ask, verdict, Outcome(r.model, day, prompt, completion, cost))


def _with_budget(ask: Ask, budget: Budget, key: str, left_ms: int) -> Ask:
    return replace(ask, budget_key=key, budget_tokens=budget.tokens or 0,
                   budget_micro=round((budget.usd or 0) * 1e6), budget_reset_ms=left_ms)

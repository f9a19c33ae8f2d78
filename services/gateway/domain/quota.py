"""Quota arithmetic for the limits stage: prices in micro-USD, the UTC day or month a
budget runs in, OpenAI's ``x-ratelimit-*`` headers and reset durations, the refusal
messages."""

from __future__ import annotations

import calendar
import math
from datetime import datetime, timezone

from llmesh.liveconfig.schema import Price, RateLimit
from llmesh.gateway.domain.limits import Verdict

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

    def __init__(self) -> None:
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

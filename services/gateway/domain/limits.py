"""Tenant limits: requests/min, tokens/min, concurrent requests, budgets.

Semantics (the same in Redis and in-process):
- requests and tokens per minute are a sliding log over the last 60 s: a
  request is admitted when what the log holds plus its own amount fits, so the
  limit holds exactly at every instant and across every gateway sharing the log;
- tokens are reserved at admission (input counted + max_tokens) and reconciled to
  the real count when the request ends;
- concurrency is a set of leases (a crashed gateway's lease expires);
- a budget admits while the period's spend plus in-flight reservations is under
  the line, so at most one request ends past it.

``RedisLimiter`` (``limits_redis``) does each admission in one Lua script (atomic
across replicas); ``LocalLimiter`` is the per-replica fallback; ``FallbackLimiter`` uses Redis and
falls back to the local one while Redis is unreachable."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from llmesh.gateway.domain.limits_redis import RedisLimiter

log = logging.getLogger("llmesh.gateway.limits")

WINDOW_MS = 60_000


@dataclass(frozen=True, slots=True)
class Ask:
    """One request's claim on its tenant's limits (0 = no such limit)."""
    tenant: str
    rid: str
    tokens: int
    rpm: int = 0
    tpm: int = 0
    concurrency: int = 0
    lease_ms: int = 600_000
    budget_key: str = ""
    budget_tokens: int = 0
    budget_micro: int = 0
    cost_micro: int = 0
    budget_reset_ms: int = 0


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    limit: str = ""            # requests | tokens | concurrency | budget when refused
    retry_after_ms: int = 0
    requests_used: int = 0
    tokens_used: int = 0
    requests_reset_ms: int = 0
    tokens_reset_ms: int = 0
    where: str = "redis"       # redis | local


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the request really used, to reconcile its reservation and to bill."""
    model: str
    day: str
    prompt_tokens: int
    completion_tokens: int
    cost_micro: int
    # A cache hit: spent nothing above, and saved these (the cached answer's usage and its price).
    cache_hit: bool = False
    saved_prompt_tokens: int = 0
    saved_completion_tokens: int = 0
    saved_micro: int = 0


class Limiter(Protocol):
    async def admit(self, ask: Ask, now_ms: int) -> Verdict: ...
    async def settle(self, ask: Ask, verdict: Verdict, outcome: Outcome | None) -> None:
        """Release the lease and reconcile; ``outcome`` None: nothing was used."""


def usage_fields(tenant: str, outcome: Outcome) -> dict[str, int]:
    """The usage hash's fields for one request: 'tenant\\tmodel\\tcounter'."""
    base = f"{tenant}\t{outcome.model}\t"
    fields = {base + "requests": 1, base + "prompt_tokens": outcome.prompt_tokens,
              base + "completion_tokens": outcome.completion_tokens, base + "micro_usd": outcome.cost_micro}
    if outcome.cache_hit:  # only then: a mesh without a cache keeps the four fields it always had
        fields.update({base + "cache_hits": 1, base + "saved_prompt_tokens": outcome.saved_prompt_tokens,
                       base + "saved_completion_tokens": outcome.saved_completion_tokens,
                       base + "saved_micro_usd": outcome.saved_micro})
    return fields


def usage_key(day: str) -> str:
    return f"llmesh:usage:{day}"


@dataclass
class _TenantState:
    requests: deque[tuple[int, str]] = field(default_factory=deque)  # (ms, rid)
    tokens: deque[tuple[int, str]] = field(default_factory=deque)    # (ms, rid)
    amounts: dict[str, int] = field(default_factory=dict)
    token_sum: int = 0
    leases: dict[str, int] = field(default_factory=dict)  # rid -> expiry ms


class LocalLimiter:
    """The same semantics in one process: each replica enforces each limit alone."""

    def __init__(self) -> None:
        self._tenants: dict[str, _TenantState] = {}
        self._budgets: dict[str, list[int]] = {}  # key -> [tokens, micro, reserved tokens, reserved micro]
        self.usage: dict[str, dict[str, int]] = {}  # day -> usage fields not yet stored elsewhere

    def _expire(self, st: _TenantState, now: int) -> None:
        cutoff = now - WINDOW_MS
        while st.requests and st.requests[0][0] <= cutoff:
            st.requests.popleft()
        while st.tokens and st.tokens[0][0] <= cutoff:
            _, rid = st.tokens.popleft()
            st.token_sum -= st.amounts.pop(rid, 0)
        for rid in [r for r, until in st.leases.items() if until <= now]:
            del st.leases[rid]

    async def admit(self, ask: Ask, now_ms: int) -> Verdict:
        st = self._tenants.setdefault(ask.tenant, _TenantState())
        self._expire(st, now_ms)
        req_used, tok_used = len(st.requests), st.token_sum
        req_reset = st.requests[0][0] + WINDOW_MS - now_ms if st.requests else 0
        tok_reset = st.tokens[0][0] + WINDOW_MS - now_ms if st.tokens else 0

        def no(limit: str, retry: int) -> Verdict:
            return Verdict(False, limit, retry, req_used, tok_used, req_reset, tok_reset, "local")

        if ask.rpm and req_used + 1 > ask.rpm:
            return no("requests", req_reset)
        if ask.tpm and tok_used + ask.tokens > ask.tpm:
            retry, need, freed = WINDOW_MS, tok_used + ask.tokens - ask.tpm, 0
            if ask.tokens <= ask.tpm:
                for ms, rid in st.tokens:
                    freed += st.amounts.get(rid, 0)
                    if freed >= need:
                        retry = ms + WINDOW_MS - now_ms
                        break
            return no("tokens", retry)
        if ask.concurrency and len(st.leases) >= ask.concurrency:
            return no("concurrency", 1000)
        if ask.budget_tokens or ask.budget_micro:
            b = self._budgets.setdefault(ask.budget_key, [0, 0, 0, 0])
            if ((ask.budget_tokens and b[0] + b[2] >= ask.budget_tokens)
                    or (ask.budget_micro and b[1] + b[3] >= ask.budget_micro)):
                return no("budget", ask.budget_reset_ms)
            b[2] += ask.tokens
            b[3] += ask.cost_micro
        if ask.rpm:
            st.requests.append((now_ms, ask.rid))
            req_used += 1
        if ask.tpm:
            st.tokens.append((now_ms, ask.rid))
            st.amounts[ask.rid] = ask.tokens
            st.token_sum += ask.tokens
            tok_used += ask.tokens
        if ask.concurrency:
            st.leases[ask.rid] = now_ms + ask.lease_ms
        return Verdict(True, "", 0, req_used, tok_used, req_reset, tok_reset, "local")

    async def settle(self, ask: Ask, verdict: Verdict, outcome: Outcome | None) -> None:
        st = self._tenants.get(ask.tenant)
        actual = 0 if outcome is None else outcome.prompt_tokens + outcome.completion_tokens
        if st is not None:
            st.leases.pop(ask.rid, None)
            if ask.rid in st.amounts:
                st.token_sum += actual - st.amounts[ask.rid]
                st.amounts[ask.rid] = actual
        if ask.budget_tokens or ask.budget_micro:
            b = self._budgets.setdefault(ask.budget_key, [0, 0, 0, 0])
            b[2] -= ask.tokens
            b[3] -= ask.cost_micro
            b[0] += actual
            b[1] += 0 if outcome is None else outcome.cost_micro
        if outcome is not None:
            self.add_usage(ask.tenant, outcome)

    def add_usage(self, tenant: str, outcome: Outcome) -> None:
        day = self.usage.setdefault(outcome.day, {})
        for name, value in usage_fields(tenant, outcome).items():
            day[name] = day.get(name, 0) + value


class FallbackLimiter:
    """Redis first; while Redis fails, the local limiter (per replica) so serving
    goes on. Usage counted meanwhile is written to Redis once it answers again."""

    def __init__(self, redis: RedisLimiter, local: LocalLimiter, retry_s: float = 1.0,
                 errors: tuple[type[BaseException], ...] = (OSError,),
                 clock: Callable[[], float] = time.monotonic, on_fallback: Callable[[], None] = lambda: None):
        self._redis = redis
        self._local = local
        self._retry_s = retry_s
        self._errors = errors
        self._clock = clock
        self._down_until = 0.0
        self._on_fallback = on_fallback

    def _failed(self, exc: BaseException) -> None:
        if self._clock() >= self._down_until:
            log.warning("redis unreachable: limits fall back to this replica", extra={"error": repr(exc)}, exc_info=exc)
        self._down_until = self._clock() + self._retry_s
        self._on_fallback()

    async def admit(self, ask: Ask, now_ms: int) -> Verdict:
        if self._clock() >= self._down_until:
            try:
                verdict = await self._redis.admit(ask, now_ms)
                await self._flush()
                return verdict
            except self._errors as exc:
                self._failed(exc)
        return await self._local.admit(ask, now_ms)

    async def settle(self, ask: Ask, verdict: Verdict, outcome: Outcome | None) -> None:
        if verdict.where == "redis":
            try:
                return await self._redis.settle(ask, verdict, outcome)
            except self._errors as exc:
                self._failed(exc)
                # Redis's lease and reservation expire there on their own; keep the usage.
                if outcome is not None:
                    self._local.add_usage(ask.tenant, outcome)
                return
        await self._local.settle(ask, verdict, outcome)

    async def _flush(self) -> None:
        while self._local.usage:
            day, fields = self._local.usage.popitem()
            try:
                await self._redis.add_usage(day, fields)
            except BaseException:
                self._local.usage[day] = fields
                raise

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

``RedisLimiter`` does each admission in one Lua script (atomic across replicas);
``LocalLimiter`` is the per-replica fallback; ``FallbackLimiter`` uses Redis and
falls back to the local one while Redis is unreachable."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

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


class Limiter(Protocol):
    async def admit(self, ask: Ask, now_ms: int) -> Verdict: ...
    async def settle(self, ask: Ask, verdict: Verdict, outcome: Outcome | None) -> None:
        """Release the lease and reconcile; ``outcome`` None: nothing was used."""


ADMIT = """
local now, rid = tonumber(ARGV[1]), ARGV[2]
local rpm, tpm, tokens = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local conc, lease = tonumber(ARGV[6]), tonumber(ARGV[7])
local btok, bmic, cost, breset = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local window = tonumber(ARGV[12])
local cutoff = now - window
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff)
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff)
if #old > 0 then
  local freed = 0
  for _, a in ipairs(redis.call('HMGET', KEYS[3], unpack(old))) do freed = freed + (tonumber(a) or 0) end
  redis.call('HDEL', KEYS[3], unpack(old))
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', cutoff)
  redis.call('DECRBY', KEYS[4], freed)
end
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
local req_used = redis.call('ZCARD', KEYS[1])
local tok_used = tonumber(redis.call('GET', KEYS[4]) or '0')
local function reset_of(key)
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if #first == 0 then return 0 end
  return tonumber(first[2]) + window - now
end
local req_reset, tok_reset = reset_of(KEYS[1]), reset_of(KEYS[2])
if rpm > 0 and req_used + 1 > rpm then
  return {0, 'requests', req_reset, req_used, tok_used, req_reset, tok_reset}
end
if tpm > 0 and tok_used + tokens > tpm then
  local retry = window
  if tokens <= tpm then
    local need, freed = tok_used + tokens - tpm, 0
    local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
    for i = 1, #entries, 2 do
      freed = freed + (tonumber(redis.call('HGET', KEYS[3], entries[i])) or 0)
      if freed >= need then retry = tonumber(entries[i + 1]) + window - now; break end
    end
  end
  return {0, 'tokens', retry, req_used, tok_used, req_reset, tok_reset}
end
if conc > 0 and redis.call('ZCARD', KEYS[5]) >= conc then
  return {0, 'concurrency', 1000, req_used, tok_used, req_reset, tok_reset}
end
if btok > 0 or bmic > 0 then
  local b = redis.call('HMGET', KEYS[6], 'tokens', 'micro', 'rtokens', 'rmicro')
  local t = (tonumber(b[1]) or 0) + (tonumber(b[3]) or 0)
  local m = (tonumber(b[2]) or 0) + (tonumber(b[4]) or 0)
  if (btok > 0 and t >= btok) or (bmic > 0 and m >= bmic) then
    return {0, 'budget', breset, req_used, tok_used, req_reset, tok_reset}
  end
  redis.call('HINCRBY', KEYS[6], 'rtokens', ARGV[5])  -- the strings: large numbers stay integers
  redis.call('HINCRBY', KEYS[6], 'rmicro', ARGV[10])
  redis.call('PEXPIRE', KEYS[6], breset + 86400000)
end
if rpm > 0 then
  redis.call('ZADD', KEYS[1], now, rid)
  redis.call('PEXPIRE', KEYS[1], window)
  req_used = req_used + 1
end
if tpm > 0 then
  redis.call('ZADD', KEYS[2], now, rid)
  redis.call('HSET', KEYS[3], rid, tokens)
  redis.call('INCRBY', KEYS[4], tokens)
  for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], window) end
  tok_used = tok_used + tokens
end
if conc > 0 then
  redis.call('ZADD', KEYS[5], now + lease, rid)
  redis.call('PEXPIRE', KEYS[5], lease)
end
return {1, '', 0, req_used, tok_used, req_reset, tok_reset}
"""

SETTLE = """
local rid, reserved, actual = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local rmicro, micro, budget = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'
if redis.call('ZSCORE', KEYS[1], rid) then
  local old = tonumber(redis.call('HGET', KEYS[2], rid) or '0')
  redis.call('HSET', KEYS[2], rid, actual)
  redis.call('INCRBY', KEYS[3], actual - old)
end
redis.call('ZREM', KEYS[4], rid)
if budget then
  redis.call('HINCRBY', KEYS[5], 'rtokens', 0 - reserved)
  redis.call('HINCRBY', KEYS[5], 'rmicro', 0 - rmicro)  -- 0 - x: never '-0', which Redis refuses
  redis.call('HINCRBY', KEYS[5], 'tokens', ARGV[3])
  redis.call('HINCRBY', KEYS[5], 'micro', ARGV[5])
end
if ARGV[7] ~= '' then
  for i = 7, #ARGV, 2 do redis.call('HINCRBY', KEYS[6], ARGV[i], tonumber(ARGV[i + 1])) end
  redis.call('EXPIRE', KEYS[6], 400 * 86400)
end
return 1
"""


def usage_fields(tenant: str, outcome: Outcome) -> dict[str, int]:
    """The usage hash's fields for one request: 'tenant\\tmodel\\tcounter'."""
    base = f"{tenant}\t{outcome.model}\t"
    return {base + "requests": 1, base + "prompt_tokens": outcome.prompt_tokens,
            base + "completion_tokens": outcome.completion_tokens, base + "micro_usd": outcome.cost_micro}


def usage_key(day: str) -> str:
    return f"llmesh:usage:{day}"


def _keys(tenant: str) -> list[str]:
    base = f"llmesh:rl:{{{tenant}}}:"  # one hash slot per tenant (Redis Cluster)
    return [base + "req", base + "tok", base + "tok:amt", base + "tok:sum", base + "conc"]


class RedisLimiter:
    """Admissions are one script call each (on the request's path). Settles come
    after the answer, so they are batched: those that arrive while a batch is on
    the wire go together in the next pipeline, one round trip for all."""

    def __init__(self, client):
        self._redis = client
        self._admit = client.register_script(ADMIT)
        self._settle = client.register_script(SETTLE)
        self._pending: list[tuple[list, list, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None

    async def admit(self, ask: Ask, now_ms: int) -> Verdict:
        res = await self._admit(keys=[*_keys(ask.tenant), ask.budget_key or "llmesh:budget:none"], args=[
            now_ms, ask.rid, ask.rpm, ask.tpm, ask.tokens, ask.concurrency, ask.lease_ms,
            ask.budget_tokens, ask.budget_micro, ask.cost_micro, ask.budget_reset_ms, WINDOW_MS])
        limit = res[1].decode() if isinstance(res[1], bytes) else res[1]
        return Verdict(bool(res[0]), limit, int(res[2]), int(res[3]), int(res[4]), int(res[5]), int(res[6]))

    async def settle(self, ask: Ask, verdict: Verdict, outcome: Outcome | None) -> None:
        await self.settle_raw(ask, outcome, {} if outcome is None else usage_fields(ask.tenant, outcome))

    async def settle_raw(self, ask: Ask, outcome: Outcome | None, usage: dict[str, int]) -> None:
        keys = _keys(ask.tenant)
        actual = 0 if outcome is None else outcome.prompt_tokens + outcome.completion_tokens
        micro = 0 if outcome is None else outcome.cost_micro
        day = outcome.day if outcome is not None else "none"
        args = [ask.rid, ask.tokens, actual, ask.cost_micro, micro,
                "1" if (ask.budget_tokens or ask.budget_micro) else "0"]
        for name, value in usage.items():
            args += [name, value]
        if not usage:
            args.append("")
        done = asyncio.get_running_loop().create_future()
        self._pending.append(([keys[1], keys[2], keys[3], keys[4], ask.budget_key or "llmesh:budget:none",
                               usage_key(day)], args, done))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        await asyncio.shield(done)

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    if len(batch) == 1:  # a pipeline of one costs twice a plain call
                        await self._settle(keys=batch[0][0], args=batch[0][1])
                    else:
                        pipe = self._redis.pipeline(transaction=False)
                        for keys, args, _ in batch:
                            await self._settle(keys=keys, args=args, client=pipe)  # queued on the pipeline
                        await pipe.execute()
                except Exception as exc:  # noqa: BLE001 - each waiter gets the batch's error
                    for _, _, done in batch:
                        done.set_exception(exc)
                        done.exception()  # retrieved: a waiter that went away leaves no warning
                else:
                    for _, _, done in batch:
                        done.set_result(None)
        finally:
            self._flusher = None

    async def add_usage(self, day: str, fields: dict[str, int]) -> None:
        pipe = self._redis.pipeline(transaction=True)
        for name, value in fields.items():
            pipe.hincrby(usage_key(day), name, value)
        pipe.expire(usage_key(day), 400 * 86400)
        await pipe.execute()


@dataclass
class _TenantState:
    requests: deque = field(default_factory=deque)        # (ms, rid)
    tokens: deque = field(default_factory=deque)          # (ms, rid)
    amounts: dict[str, int] = field(default_factory=dict)
    token_sum: int = 0
    leases: dict[str, int] = field(default_factory=dict)  # rid -> expiry ms


class LocalLimiter:
    """The same semantics in one process: each replica enforces each limit alone."""

    def __init__(self):
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

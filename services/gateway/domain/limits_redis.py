"""Tenant limits on Redis (the semantics are in ``limits``): each admission is one
Lua script call, atomic across every gateway replica sharing the Redis; settles are
batched into pipelines. It takes a ``redis.asyncio`` client and imports no transport."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from llmesh.gateway.domain.limits import WINDOW_MS, Ask, Outcome, Verdict, usage_fields, usage_key

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


def _keys(tenant: str) -> list[str]:
    base = f"llmesh:rl:{{{tenant}}}:"  # one hash slot per tenant (Redis Cluster)
    return [base + "req", base + "tok", base + "tok:amt", base + "tok:sum", base + "conc"]


class RedisClient(Protocol):
    """What this module uses of a ``redis.asyncio`` client (Redis or RedisCluster)."""

    def register_script(self, script: str) -> Any: ...

    def pipeline(self, transaction: bool = True) -> Any: ...


class RedisLimiter:
    """Admissions are one script call each (on the request's path). Settles come
    after the answer, so they are batched: those that arrive while a batch is on
    the wire go together in the next pipeline, one round trip for all."""

    def __init__(self, client: RedisClient):
        self._redis = client
        self._admit = client.register_script(ADMIT)
        self._settle = client.register_script(SETTLE)
        self._pending: list[tuple[list[str], list[str | int], asyncio.Future[None]]] = []  # keys, args, waiter
        self._flusher: asyncio.Task[None] | None = None

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
        args: list[str | int] = [ask.rid, ask.tokens, actual, ask.cost_micro, micro,
                "1" if (ask.budget_tokens or ask.budget_micro) else "0"]
        for name, value in usage.items():
            args += [name, value]
        if not usage:
            args.append("")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
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

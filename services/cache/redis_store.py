"""The Redis store: entries shared by every cache replica and kept across restarts.

Layout (``ns`` is the namespace, ``T`` the percent-quoted tenant, ``M`` the model):
    ns:{T}:e:M:KIND:DIGEST   hash: r (response), and for semantic entries v, q, s; PEXPIRE ttl
    ns:{T}:lru               sorted set: entry key -> last use (ms); the per-tenant cap evicts its lowest
    ns:{T}:stats             hash of counters
    ns:tenants               set of tenants that stored something
A tenant's keys share one hash tag, so the scripts stay valid on Redis Cluster.
Redis 7.0 (Debian) has no vector search; the index lives in the cache service."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from urllib.parse import quote, unquote

import redis.asyncio as aioredis

from llmesh.cache.store import Entry, Name, Selector, Stored, TenantStats

# KEYS: entry, lru, stats, tenants. ARGV: ttl_ms, now_ms, cap, tenant, field, value, ...
_PUT = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], KEYS[1])
redis.call('SADD', KEYS[4], ARGV[4])
redis.call('HINCRBY', KEYS[3], 'stores', 1)
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
local evicted = {}
if over > 0 then
  local old = redis.call('ZPOPMIN', KEYS[2], over)
  for i = 1, #old, 2 do
    if redis.call('DEL', old[i]) == 1 then evicted[#evicted + 1] = old[i] end
  end
  redis.call('HINCRBY', KEYS[3], 'evictions', #evicted)
end
return evicted
"""

# KEYS: lru. Drops members whose entry has expired; returns how many are left.
_PRUNE = """
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, key in ipairs(members) do
  if redis.call('EXISTS', key) == 0 then redis.call('ZREM', KEYS[1], key) end
end
return redis.call('ZCARD', KEYS[1])
"""


def _q(part: str) -> str:
    return quote(part, safe="")


def _glob(part: str) -> str:
    """A quoted name is safe in a SCAN pattern except for what quote() leaves alone."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in _q(part))


class RedisStore:
    backend = "redis"

    def __init__(self, url: str, max_entries_per_tenant: int, timeout_s: float, namespace: str = "llmesh:cache",
                 client: aioredis.Redis | None = None):
        self._redis = client or aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=0)
        self._ns = namespace
        self._channel = f"{namespace}:semantic-stored"
        self._url = url
        self._max = max_entries_per_tenant
        self._put = self._redis.register_script(_PUT)
        self._prune = self._redis.register_script(_PRUNE)

    def key(self, name: Name) -> str:
        return f"{self._ns}:{{{_q(name.tenant)}}}:e:{_q(name.model)}:{name.kind}:{name.digest}"

    def _tenant_key(self, tenant: str, what: str) -> str:
        return f"{self._ns}:{{{_q(tenant)}}}:{what}"

    def name(self, key: str | bytes) -> Name:
        if isinstance(key, bytes):
            key = key.decode()
        tenant, _, model, kind, digest = key[len(self._ns) + 1:].split(":")
        return Name(unquote(tenant[1:-1]), unquote(model), kind, digest)  # type: ignore[arg-type]

    async def get(self, name: Name) -> Entry | None:
        key = self.key(name)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(key)
            pipe.zadd(self._tenant_key(name.tenant, "lru"), {key: int(time.time() * 1000)}, xx=True)
            fields, _ = await pipe.execute()
        if not fields:
            return None
        return _entry(fields)

    async def put(self, name: Name, entry: Entry, ttl_s: float) -> list[Name]:
        fields: list = [b"r", entry.response]
        if name.kind == "s":
            fields += [b"v", entry.vector, b"q", entry.text.encode(), b"s", entry.scope.encode()]
        key = self.key(name)
        evicted = await self._put(
            keys=[key, self._tenant_key(name.tenant, "lru"), self._tenant_key(name.tenant, "stats"),
                  f"{self._ns}:tenants"],
            args=[max(1, int(ttl_s * 1000)), int(time.time() * 1000), self._max, name.tenant, *fields])
        if name.kind == "s":  # other cache replicas add it to their index
            await self._redis.publish(self._channel, key)
        return [self.name(k) for k in evicted]

    async def count(self, tenant: str, counter: str, n: int = 1) -> None:
        await self._redis.hincrby(self._tenant_key(tenant, "stats"), counter, n)

    async def _scan(self, pattern: str) -> AsyncIterator[bytes]:
        async for key in self._redis.scan_iter(match=pattern, count=1000):
            yield key

    async def invalidate(self, selector: Selector) -> list[Name]:
        tenant = _glob(selector.tenant) if selector.tenant is not None else "*"
        model = _glob(selector.model) if selector.model is not None else "*"
        prefix = "".join(c for c in selector.prefix if c in "0123456789abcdef")
        if prefix != selector.prefix:
            return []  # digests are lower-case hex: nothing else can match
        pattern = f"{self._ns}:{{{tenant}}}:e:{model}:*:{prefix}*"
        removed: list[Name] = []
        batch: list[bytes] = []
        async for key in self._scan(pattern):
            name = self.name(key)
            if selector.matches(name):  # the pattern is a superset (a model named 'a' also globs 'a:b')
                batch.append(key)
                removed.append(name)
            if len(batch) >= 500:
                await self._unlink(batch)
                batch = []
        if batch:
            await self._unlink(batch)
        return removed

    async def _unlink(self, keys: list[bytes]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.unlink(key)
                pipe.zrem(self._tenant_key(self.name(key).tenant, "lru"), key)
            await pipe.execute()

    async def stats(self, tenant: str | None = None) -> dict[str, TenantStats]:
        if tenant is not None:
            tenants = [tenant]
        else:
            members = await self._redis.smembers(f"{self._ns}:tenants")  # bytes: no decode_responses
            tenants = sorted(t.decode() if isinstance(t, bytes) else t for t in members)
        out = {}
        for t in tenants:
            entries = await self._prune(keys=[self._tenant_key(t, "lru")])
            counters = await self._redis.hgetall(self._tenant_key(t, "stats"))
            out[t] = TenantStats(entries, *(int(counters.get(c.encode(), 0)) for c in TenantStats.COUNTERS))
        return out

    async def semantic_entries(self) -> AsyncIterator[Stored]:
        keys: list[bytes] = []
        async for key in self._scan(f"{self._ns}:*:e:*:s:*"):
            keys.append(key)
            if len(keys) >= 500:
                for stored in await self._read(keys):
                    yield stored
                keys = []
        for stored in await self._read(keys):
            yield stored

    async def _read(self, keys: list[bytes]) -> list[Stored]:
        if not keys:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
                pipe.pttl(key)
            replies = await pipe.execute()
        out = []
        for key, fields, pttl in zip(keys, replies[::2], replies[1::2]):
            if fields and pttl > 0:
                out.append(Stored(self.name(key), _entry(fields), pttl / 1000))
        return out

    async def watch_semantic(self) -> AsyncIterator[Stored | None]:
        # A connection of its own with no read timeout: it waits for messages.
        listener = aioredis.Redis.from_url(self._url, socket_connect_timeout=2.0, health_check_interval=10)
        pubsub = listener.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._channel)
            yield None
            async for message in pubsub.listen():
                for stored in await self._read([message["data"]]):
                    yield stored
        finally:
            await pubsub.aclose()
            await listener.aclose()

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()


def _entry(fields: dict[bytes, bytes]) -> Entry:
    return Entry(response=fields[b"r"], vector=fields.get(b"v", b""), text=fields.get(b"q", b"").decode(),
                 scope=fields.get(b"s", b"").decode())

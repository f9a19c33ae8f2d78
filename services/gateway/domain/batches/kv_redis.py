"""``Kv`` on Redis, shared by every gateway worker: blobs are strings, a results set a
hash (HSETNX: the first value written stays) with its counts in a second hash, updated in
one Lua script; an index a sorted set. It takes a ``redis.asyncio`` client and imports no
transport. Every key lives ``ttl_s`` from its last write, so nothing outlives retention."""

from __future__ import annotations

from typing import Any

SWAP = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) return 1
end
return 0
"""
RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  redis.call('EXPIRE', KEYS[1], ARGV[4]) redis.call('EXPIRE', KEYS[2], ARGV[4])
  return 1
end
return 0
"""
PREFIX = "llmesh:batch:"


class RedisKv:
    def __init__(self, redis: Any, ttl_s: int):
        self._redis = redis
        self._ttl = ttl_s
        self._swap = redis.register_script(SWAP)
        self._record = redis.register_script(RECORD)

    async def get(self, key: str) -> bytes | None:
        value: bytes | None = await self._redis.get(PREFIX + key)
        return value

    async def put(self, key: str, value: bytes) -> None:
        await self._redis.set(PREFIX + key, value, ex=self._ttl)

    async def delete(self, *keys: str) -> None:
        names = [PREFIX + k for k in keys]
        await self._redis.delete(*names, *(n + ":n" for n in names))

    async def swap(self, key: str, old: bytes, new: bytes) -> bool:
        return bool(await self._swap(keys=[PREFIX + key], args=[old, new, self._ttl]))

    async def record(self, key: str, field: str, kind: str, value: bytes) -> bool:
        name = PREFIX + key
        return bool(await self._record(keys=[name, name + ":n"], args=[field, kind.encode() + b"|" + value, kind,
                                                                       self._ttl]))

    async def recorded(self, key: str, field: str) -> bool:
        return bool(await self._redis.hexists(PREFIX + key, field))

    async def counts(self, key: str) -> dict[str, int]:
        raw = await self._redis.hgetall(PREFIX + key + ":n")
        return {k.decode(): int(v) for k, v in raw.items()}

    async def results(self, key: str) -> dict[str, tuple[str, bytes]]:
        out: dict[str, tuple[str, bytes]] = {}
        async for field, value in self._redis.hscan_iter(PREFIX + key, count=1000):
            kind, _, body = value.partition(b"|")
            out[field.decode()] = (kind.decode(), body)
        return out

    async def index_add(self, key: str, member: str, score: int) -> None:
        """Scores are microseconds since the epoch: members older than the retention go (their
        records expired), and the index itself expires with its last addition."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zadd(PREFIX + key, {member: score})
            pipe.zremrangebyscore(PREFIX + key, "-inf", score - self._ttl * 1_000_000)
            pipe.expire(PREFIX + key, self._ttl)
            await pipe.execute()

    async def index_remove(self, key: str, member: str) -> None:
        await self._redis.zrem(PREFIX + key, member)

    async def index_page(self, key: str, after: str | None, limit: int) -> tuple[list[str], bool]:
        start = 0
        if after is not None:
            rank = await self._redis.zrevrank(PREFIX + key, after)
            if rank is None:
                return [], False
            start = rank + 1
        members = await self._redis.zrevrange(PREFIX + key, start, start + limit)
        return [m.decode() for m in members[:limit]], len(members) > limit

    async def index_len(self, key: str) -> int:
        return int(await self._redis.zcard(PREFIX + key))

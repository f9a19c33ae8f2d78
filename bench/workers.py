"""A gateway of several worker processes for a bench's mesh (``--gateway-workers N``):
the ``llmesh up`` flags and environment, and the Redis the workers share (started here,
for N = 1 too, so that 1 and N compare like with like).

A gateway whose API keys are in Redis requires credentials (llmesh.gateway.domain.auth_mode),
so an API key is made in that Redis, as the gateway reads it (llmesh.keys.RedisKeyStore), for
the tenant ``TENANT``: the bench's config must grant it (its ``"*"`` tenant does). The
requests to the gateway, and only those, carry it (``Workers.headers``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from llmesh.testing import RedisServer

TENANT = "bench"


@dataclass(frozen=True)
class Workers:
    """What a bench's mesh and its gateway requests need: nothing when the gateway is one
    process without Redis."""
    flags: list[str] = field(default_factory=list)  # for Mesh's args (llmesh up)
    env: dict[str, str] = field(default_factory=dict)  # for Mesh's env
    headers: dict[str, str] = field(default_factory=dict)  # for every request to the gateway


async def _put_key(redis_url: str, tenant: str) -> str:
    import redis.asyncio

    from llmesh.keys import RedisKeyStore, new_key

    plaintext, record = new_key(tenant)
    client = redis.asyncio.from_url(redis_url)
    try:
        await RedisKeyStore(client).put(record)
    finally:
        await client.aclose()
    return plaintext


@contextlib.contextmanager
def gateway_workers(n: int | None, tmp: Path) -> Iterator[Workers]:
    if n is None:
        yield Workers()
        return
    redis = RedisServer(tmp / "redis")
    redis.start()
    try:
        key = asyncio.run(_put_key(redis.url, TENANT))
        yield Workers(["--gateway-workers", str(n)], {"LLMESH_REDIS_URL": redis.url},
                      {"authorization": f"Bearer {key}"})
    finally:
        redis.stop()

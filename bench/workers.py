"""A gateway of several worker processes for a bench's mesh (``--gateway-workers N``):
the ``llmesh up`` flags and environment, and the Redis the workers share (started here,
for N = 1 too, so that 1 and N compare like with like)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from llmesh.testing import RedisServer


@contextlib.contextmanager
def gateway_workers(n: int | None, tmp: Path) -> Iterator[tuple[list[str], dict[str, str]]]:
    """(flags, env) for ``Mesh``: nothing when ``n`` is None (one gateway process, no Redis)."""
    if n is None:
        yield [], {}
        return
    redis = RedisServer(tmp / "redis")
    redis.start()
    try:
        yield ["--gateway-workers", str(n)], {"LLMESH_REDIS_URL": redis.url}
    finally:
        redis.stop()

"""Shares the picker's load ledger with the other gateway processes on the same Redis (workers
and replicas; picking.peers): every ``interval_s`` one pipelined round trip writes this
process's counts into one hash and reads everyone's. Off the request path: a pick reads the
last sums. While Redis does not answer, the peers' counts are dropped and each process routes
on its own ledger and the engines' reports, as a lone gateway does."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from llmesh.gateway.upstream.picking.peers import PeerLoads, snapshot
from llmesh.gateway.upstream.picking.types import LocalState

log = logging.getLogger("llmesh.gateway.ledger")

KEY = "llmesh:ledger"


class LedgerShare:
    def __init__(self, redis: Any, local: LocalState, interval_s: float = 0.05,
                 errors: tuple[type[BaseException], ...] = (OSError,), retry_s: float = 2.0,
                 name: str | None = None, clock: Callable[[], float] = time.monotonic):
        self._redis = redis
        self._local = local
        self._interval = interval_s
        self._errors = errors
        self._retry_s = retry_s
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._peers = PeerLoads(self.name, stale_s=max(1.0, 20 * interval_s))
        self._seq = itertools.count(1)
        self._clock = clock
        self._failing = False

    async def sync(self) -> None:
        """Publishes ours, reads theirs, drops the long-dead."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(KEY, self.name, snapshot(self._local, next(self._seq)))
        pipe.hgetall(KEY)
        _, published = await pipe.execute()
        self._local.peers, forget = self._peers.update(published, self._clock())
        if forget:
            await self._redis.hdel(KEY, *forget)

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.sync()
                except self._errors as exc:
                    self._local.peers = {}
                    if not self._failing:
                        log.warning("load ledger not shared: Redis does not answer", extra={"error": repr(exc)})
                    self._failing = True
                    await asyncio.sleep(self._retry_s)
                    continue
                if self._failing:
                    log.info("load ledger shared again")
                    self._failing = False
                await asyncio.sleep(self._interval)
        finally:
            self._local.peers = {}

    async def leave(self) -> None:
        """Takes this process's counts out of the store (a clean stop; a killed one lapses)."""
        try:
            await self._redis.hdel(KEY, self.name)
        except self._errors:
            pass

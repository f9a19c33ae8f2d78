"""Shares the picker's load ledger with the other gateway processes on the same Redis (workers
and replicas; picking.peers): every ``interval_s`` one pipelined round trip writes this
process's counts into one hash and reads everyone's (who is alive, and a start from nothing);
between rounds each change of the ledger is pushed at once on a channel (coalesced while one is
on its way) and the others take it as it comes: a request that just ended on an engine is not
counted there by the next process a follow-up reaches (at 50 ms rounds alone, bench.routing_replicas'
follow-ups kept their engine 0.54 of the time with 3 workers, 0.80 with one). Off the request path:
a pick reads the last sums. A round that does not finish within a second, or fails in any way, drops the
peers' counts until one does: each process then routes on its own ledger and the engines'
reports, as a lone gateway does. Give it a client of its own, so that it neither waits for
nor takes the request path's connections."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from llmesh.background import honour_cancel
from llmesh.gateway.upstream.picking.peers import MIN_STALE_S, PeerLoads, snapshot
from llmesh.gateway.upstream.picking.types import PEER_COUNTS, LocalState

log = logging.getLogger("llmesh.gateway.ledger")

KEY = "llmesh:ledger"
CHANNEL = "llmesh:ledger:push"  # messages: "<name>\n<snapshot>"
_INFLIGHT = PEER_COUNTS.index("inflight")
_NONE = (0,) * len(PEER_COUNTS)


class LedgerShare:
    def __init__(self, redis: Any, local: LocalState, interval_s: float = 0.05, retry_s: float = 2.0,
                 name: str | None = None, clock: Callable[[], float] = time.monotonic,
                 on_drop: Callable[[], None] = lambda: None, on_round: Callable[[int | None], None] = lambda n: None):
        self._redis = redis
        self._local = local
        self._interval = interval_s
        self._retry_s = retry_s
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._peers = PeerLoads(self.name)
        self._seq = itertools.count(1)
        self._clock = clock
        self._on_drop = on_drop  # told when the peers' work in flight went down (slots may have freed)
        self._on_round = on_round  # told each round's live peers, or None for a failed one
        self._failing = False
        self._dirty = asyncio.Event()

    @property
    def others(self) -> int:
        """Other processes' fields in the store at the last round (alive or lapsing)."""
        return self._peers.others

    def changed(self) -> None:
        """The ledger changed: push it (the picker's ``on_ledger``), unless no other process's field
        was in the store at the last round: nobody to tell (a snapshot and its PUBLISH cost ~80 us
        of CPU here, up to three a request); a newcomer reads our rounds and is seen by our next."""
        if self._peers.others:
            self._dirty.set()

    async def _push(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            async with asyncio.timeout(MIN_STALE_S):
                await self._redis.publish(CHANNEL, f"{self.name}\n{self._snapshot()}")
            honour_cancel()

    def _snapshot(self) -> str:
        return snapshot(self._local, next(self._seq), self._interval)

    async def _listen(self) -> None:
        pubsub = self._redis.pubsub()
        try:
            await pubsub.subscribe(CHANNEL)
            while True:  # a wait of its own, not the client's socket timeout: a quiet channel is no error
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                honour_cancel()
                if message is None or message.get("type") != "message" or self._failing:
                    continue
                name, _, raw = message["data"].partition(b"\n")
                self._peers.offer(name.decode(errors="replace"), raw, self._clock())
                self._set(self._peers.sums(self._clock()), self._peers.since(self._clock()))
        finally:  # bounded: a subscription cut mid-read must not hold up a stop
            with contextlib.suppress(Exception):
                async with asyncio.timeout(MIN_STALE_S):
                    await pubsub.aclose()

    async def _pushing(self) -> None:
        """Pushes and takes pushes for as long as Redis answers; the rounds notice when it does not."""
        while True:
            tasks = [asyncio.create_task(self._push()), asyncio.create_task(self._listen())]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.wait(tasks, timeout=2 * MIN_STALE_S)  # each ends within a second once cancelled
            await asyncio.sleep(self._retry_s)

    async def sync(self) -> None:
        """Publishes ours, reads theirs (within a second), drops the long-dead (best effort)."""
        async with asyncio.timeout(MIN_STALE_S):
            pipe = self._redis.pipeline(transaction=False)
            pipe.hset(KEY, self.name, self._snapshot())
            pipe.hgetall(KEY)
            _, published = await pipe.execute()
        honour_cancel()
        peers, forget = self._peers.update(published, self._clock())
        self._set(peers, self._peers.since(self._clock()))
        if forget:
            await self._forget(forget)

    def _set(self, peers: dict[str, tuple[int, ...]], since: dict[str, tuple[tuple[int, int, int], ...]]) -> None:
        before, self._local.peers, self._local.peer_since = self._local.peers, peers, since
        if any(peers.get(eid, _NONE)[_INFLIGHT] < counts[_INFLIGHT] for eid, counts in before.items()):
            self._on_drop()

    async def _forget(self, names: list[str]) -> None:
        try:
            async with asyncio.timeout(MIN_STALE_S):
                await self._redis.hdel(KEY, *names)
            honour_cancel()
        except Exception:  # noqa: BLE001 - best effort: the next round tries again
            pass

    async def run(self) -> None:
        pushing = asyncio.create_task(self._pushing())
        try:
            while True:
                try:
                    await self.sync()
                except Exception as exc:  # noqa: BLE001 - any failure (timeout, refused, an error reply): alone
                    self._set({}, {})
                    self._on_round(None)
                    if not self._failing:
                        log.warning("load ledger not shared: each gateway process routes on its own",
                                    extra={"error": repr(exc)})
                    self._failing = True
                    await asyncio.sleep(self._retry_s)
                    continue
                self._on_round(self._peers.live)
                if self._failing:
                    log.info("load ledger shared again", extra={"peers": self._peers.live})
                    self._failing = False
                await asyncio.sleep(self._interval)
        finally:
            pushing.cancel()
            await asyncio.wait([pushing], timeout=2 * MIN_STALE_S)
            self._local.peers, self._local.peer_since = {}, {}

    async def leave(self) -> None:
        """Takes this process's counts out of the store (a clean stop; a killed one lapses)."""
        try:
            async with asyncio.timeout(MIN_STALE_S):
                await self._redis.hdel(KEY, self.name)
        except Exception:  # noqa: BLE001 - a store that does not answer: its field lapses
            pass

"""The work queue on a Redis stream with a consumer group: every gateway worker is a
consumer, so several share a batch. A line stays pending until its result is recorded
(``ack``); a line pending longer than ``claim_idle_s`` (its worker died, or is stuck) is
claimed with XAUTOCLAIM by the next worker that takes work, and run again: the store keeps
one result per line, so a line run twice is recorded once. Takes a ``redis.asyncio``
client; imports no transport."""

from __future__ import annotations

import logging
import os
import socket
import secrets
from collections.abc import Sequence
from typing import Any

from llmesh.gateway.domain.batches.lines import Line
from llmesh.gateway.domain.batches.queue import Work

log = logging.getLogger("llmesh.gateway.batches")
STREAM = "llmesh:batch:queue"
GROUP = "llmesh-batches"
PUSH_CHUNK = 500


def consumer_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class StreamQueue:
    def __init__(self, redis: Any, claim_idle_s: float, consumer: str | None = None, stream: str = STREAM):
        self._redis = redis
        self._idle_ms = int(claim_idle_s * 1000)
        self._consumer = consumer or consumer_name()
        self._stream = stream
        self._ready = False

    async def _group(self) -> None:
        if self._ready:
            return
        try:
            await self._redis.xgroup_create(self._stream, GROUP, id="0", mkstream=True)
        except Exception as exc:  # redis.exceptions.ResponseError, not imported here
            if "BUSYGROUP" not in str(exc):
                raise
        self._ready = True

    async def push(self, batch_id: str, lines: Sequence[Line]) -> None:
        await self._group()
        for start in range(0, len(lines), PUSH_CHUNK):
            async with self._redis.pipeline(transaction=False) as pipe:
                for line in lines[start:start + PUSH_CHUNK]:
                    pipe.xadd(self._stream, {"b": batch_id, "i": line.index, "c": line.custom_id, "l": line.body})
                await pipe.execute()

    async def take(self, n: int, wait_s: float) -> list[Work]:
        await self._group()
        reply = await self._redis.xautoclaim(self._stream, GROUP, self._consumer, self._idle_ms,
                                             start_id="0-0", count=n)
        claimed = reply[1]  # [next start, claimed entries, deleted ids]
        if claimed:
            log.info("batch lines claimed", extra={"lines": len(claimed), "idle_s": self._idle_ms / 1000})
            return [_work(entry_id, fields) for entry_id, fields in claimed if fields]
        answer = await self._redis.xreadgroup(GROUP, self._consumer, {self._stream: ">"}, count=n,
                                              block=max(1, int(wait_s * 1000)))
        return [_work(entry_id, fields) for _, entries in answer or [] for entry_id, fields in entries]

    async def ack(self, work: Work) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xack(self._stream, GROUP, work.token)
            pipe.xdel(self._stream, work.token)
            await pipe.execute()

    async def close(self) -> None:
        return None


def _work(entry_id: bytes, fields: dict[bytes, bytes]) -> Work:
    return Work(fields[b"b"].decode(), int(fields[b"i"]), fields[b"c"].decode(), fields[b"l"],
                token=entry_id.decode())

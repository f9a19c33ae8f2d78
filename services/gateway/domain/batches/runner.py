"""Runs batch lines: takes them from the queue and sends each through ``run_line`` (the
gateway's pipeline, as the batch's caller, at the lowest priority), records its result
once, and finalizes a batch when every line has one (output and error files, counts,
the last status).

A bounded number of lines is in flight: at most ``in_flight``, and no more than keeps a
headroom of the engines' slots free (``room()``: the lines this runner may hold, which the
gateway reads from its picker's ledger; a line taken counts from then on, before it reaches an
engine), so an interactive request arriving finds a slot instead of waiting for a batch line
to end; at least ``busy_in_flight``, so a batch still moves while interactive traffic fills
every slot (the engines admit that first anyway: Priority.LOW). A line refused for a reason
that passes (429: a limit, queue full; 503) is tried again after a pause,
``retries`` times, before it counts as failed."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from llmesh.gateway.domain.batches.model import Batch, result_line
from llmesh.gateway.domain.batches.queue import Work, WorkQueue
from llmesh.gateway.domain.batches.store import BatchStore

log = logging.getLogger("llmesh.gateway.batches")

LineRun = Callable[[Batch, Work, str], Awaitable[tuple[int, Any]]]
"""(batch, line, request id) -> (HTTP status, response body as JSON) of the line's request."""
PASSING = (429, 503)


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    in_flight: int = 8
    busy_in_flight: int = 1
    retries: int = 3
    retry_pause_s: float = 1.0
    take_wait_s: float = 1.0
    stale_finalizing_s: float = 150.0  # a batch finalizing this long lost its worker: another finalizes it


def line_id(batch_id: str, index: int) -> str:
    """The same for a line run again (another worker's claim): the result's id and request id."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{index}".encode()).hexdigest()[:24]


class BatchRunner:
    def __init__(self, store: BatchStore, queue: WorkQueue, run_line: LineRun, room: Callable[[], int],
                 settings: RunnerSettings, clock: Callable[[], float] = time.time):
        self._store = store
        self._queue = queue
        self._run_line = run_line
        self._room_for = room
        self._settings = settings
        self._clock = clock
        self._tasks: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()

    def limit(self) -> int:
        """Lines that may be in flight now, within the bounds."""
        s = self._settings
        return max(s.busy_in_flight, min(s.in_flight, self._room_for()))

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def run(self) -> None:
        """Takes lines while there is room, until cancelled (``stop``)."""
        while True:
            room = self.limit() - len(self._tasks)
            if room <= 0:
                self._room.clear()
                try:
                    await asyncio.wait_for(self._room.wait(), 0.1)  # and look at the pressure again
                except TimeoutError:
                    pass
                continue
            try:
                works = await self._queue.take(room, self._settings.take_wait_s)
            except Exception:  # a store or queue away: logged, tried again
                log.warning("batch queue not readable", exc_info=True)
                await asyncio.sleep(1.0)
                continue
            for work in works:
                task = asyncio.create_task(self._one(work))
                self._tasks.add(task)
                task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._room.set()

    async def stop(self, grace_s: float) -> None:
        """Lines in flight get ``grace_s`` to finish; those cut short stay unacknowledged
        (another worker, or this one started again, runs them)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _one(self, work: Work) -> None:
        try:
            await self._line(work)
            await self._queue.ack(work)
        except asyncio.CancelledError:
            raise
        except Exception:  # left unacknowledged: claimed again after claim_idle_s (Redis)
            log.exception("batch line failed", extra={"batch_id": work.batch_id, "line": work.index})

    async def _line(self, work: Work) -> None:
        batch = await self._store.batch(work.batch_id)
        if batch is None:
            return  # deleted, or past retention
        if not await self._store.recorded(batch.id, work.index):
            kind, line = await self._result(batch, work)
            if not await self._store.record(batch.id, work.index, kind, line):
                return  # another worker recorded it first: it finishes the batch if due
        await self.finish(batch.id)

    async def _result(self, batch: Batch, work: Work) -> tuple[str, bytes]:
        rid = line_id(batch.id, work.index)
        if batch.status in ("cancelling", "cancelled"):
            return "skipped", b""
        if self._clock() > batch.expires_at:
            return "expired", result_line(rid, work.custom_id, None, rid, None, {
                "code": "batch_expired", "message": "This request could not be executed before the completion "
                                                    "window expired."})
        status, body = await self._attempts(batch, work, rid)
        return ("completed" if status == 200 else "failed"), result_line(rid, work.custom_id, status, rid, body, None)

    def _stale(self, batch: Batch) -> bool:
        """Finalizing for longer than a worker needs: its worker died (its last line, not
        acknowledged, was claimed by another worker, which finishes the batch again)."""
        return (batch.status == "finalizing" and batch.finalizing_at is not None
                and self._clock() - batch.finalizing_at > self._settings.stale_finalizing_s)

    async def _attempts(self, batch: Batch, work: Work, rid: str) -> tuple[int, Any]:
        for attempt in range(self._settings.retries + 1):
            try:
                status, body = await self._run_line(batch, work, rid)
            except Exception:  # a bug, not the line's answer: recorded as a 500, never claimed again and again
                log.exception("batch line raised", extra={"batch_id": batch.id, "line": work.index})
                return 500, {"error": {"message": "The gateway failed to run this request.", "type": "server_error",
                                       "param": None, "code": "internal_error"}}
            if status not in PASSING or attempt == self._settings.retries:
                break
            await asyncio.sleep(self._settings.retry_pause_s * 2 ** attempt)
        return status, body

    async def finish(self, batch_id: str) -> None:
        """Once every line has a result: ``finalizing`` (one worker wins it), the output and
        error files, then ``completed`` (``cancelled`` when it was cancelling, ``expired``
        when lines expired)."""
        batch = await self._store.batch(batch_id)
        if batch is None or not (batch.status in ("in_progress", "cancelling") or self._stale(batch)):
            return
        counts = await self._store.counts(batch_id)
        if sum(counts.values()) < batch.total:
            return
        moving = await self._store.move(batch, "finalizing")
        if moving is None:
            return
        if batch.status == "finalizing":  # taken over: what it was before, from the line results
            batch = replace(batch, status="cancelling" if batch.cancelling_at is not None else "in_progress")
        results = await self._store.results(batch_id)
        out = b"".join(line + b"\n" for kind, line in results if kind == "completed")
        err = b"".join(line + b"\n" for kind, line in results if kind in ("failed", "expired"))
        ids = []
        for purpose_name, content in (("output", out), ("error", err)):
            meta = (await self._store.add_file(batch.tenant, f"{batch_id}_{purpose_name}.jsonl", "batch_output",
                                               content) if content else None)
            ids.append(meta.id if meta is not None else None)
        final = ("cancelled" if batch.status == "cancelling" else "expired" if counts.get("expired") else "completed")
        totals = {"completed": counts.get("completed", 0), "failed": counts.get("failed", 0) + counts.get("expired", 0)}
        await self._store.move(moving, final, output_file_id=ids[0], error_file_id=ids[1], counts=totals)
        await self._store.drop_results(batch_id)
        log.info("batch ended", extra={"batch_id": batch_id, "status": final, **totals})

"""The Batch API's operations, for both fronts: each takes the authenticated caller, and
a file or batch of another tenant is NotFound (404), never forbidden."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from llmesh.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from llmesh.gateway.context import Caller
from llmesh.gateway.domain.batches.lines import parse_lines
from llmesh.gateway.domain.batches.model import ENDPOINTS, ENDED, WINDOWS, Batch, new_id
from llmesh.gateway.domain.batches.queue import WorkQueue
from llmesh.gateway.domain.batches.store import BatchStore

MAX_METADATA = 16  # OpenAI's: 16 pairs, keys of 64 characters, values of 512
MAX_PAGE = 100


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_file_bytes: int = 50 << 20
    max_lines: int = 50_000
    max_files: int = 1_000  # per tenant


def _bad(message: str, param: str) -> InvalidArgument:
    return InvalidArgument(message, reason="invalid_request", param=param)


def _page(limit: int | None) -> int:
    if limit is None:
        return 20
    if not 1 <= limit <= MAX_PAGE:
        raise _bad(f"'limit' must be between 1 and {MAX_PAGE}.", "limit")
    return limit


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                       for k, v in metadata.items())):
        raise _bad(f"'metadata' holds at most {MAX_METADATA} string pairs (keys up to 64 characters, "
                   "values up to 512).", "metadata")
    return dict(metadata)


class BatchService:
    def __init__(self, store: BatchStore, queue: WorkQueue, limits: BatchLimits):
        self.store = store
        self._queue = queue
        self.limits = limits

    async def create_file(self, caller: Caller, filename: str, purpose: str, content: bytes) -> dict[str, Any]:
        if purpose != "batch":
            raise _bad("Only purpose 'batch' is supported.", "purpose")
        if len(content) > self.limits.max_file_bytes:
            raise _bad(f"A file is at most {self.limits.max_file_bytes} bytes.", "file")
        await asyncio.to_thread(parse_lines, content, self.limits.max_lines)  # linear, off the event loop
        if await self.store.file_count(caller.tenant) >= self.limits.max_files:
            raise ResourceExhausted(f"A tenant keeps at most {self.limits.max_files} files; delete some first.",
                                    reason="too_many_files")
        meta = await self.store.add_file(caller.tenant, filename[:255] or "batch.jsonl", purpose, content)
        return meta.json()

    async def file(self, caller: Caller, file_id: str) -> dict[str, Any]:
        meta = await self.store.file(caller.tenant, file_id)
        if meta is None:
            raise NotFound(f"No such File object: {file_id[:64]}", reason="not_found", param="id")
        return meta.json()

    async def files(self, caller: Caller, after: str | None = None, limit: int | None = None) -> dict[str, Any]:
        found, more = await self.store.files(caller.tenant, after, _page(limit))
        return {"object": "list", "data": [f.json() for f in found], "has_more": more,
                "first_id": found[0].id if found else None, "last_id": found[-1].id if found else None}

    async def content(self, caller: Caller, file_id: str) -> bytes:
        content = await self.store.content(caller.tenant, file_id)
        if content is None:
            raise NotFound(f"No such File object: {file_id[:64]}", reason="not_found", param="id")
        return content

    async def delete_file(self, caller: Caller, file_id: str) -> dict[str, Any]:
        if not await self.store.delete_file(caller.tenant, file_id):
            raise NotFound(f"No such File object: {file_id[:64]}", reason="not_found", param="id")
        return {"id": file_id, "object": "file", "deleted": True}

    async def create_batch(self, caller: Caller, input_file_id: str, endpoint: str, completion_window: str,
                           metadata: Any = None) -> dict[str, Any]:
        if endpoint not in ENDPOINTS:
            raise _bad(f"'endpoint' must be one of {', '.join(ENDPOINTS)}.", "endpoint")
        if completion_window not in WINDOWS:
            raise _bad("'completion_window' must be '24h'.", "completion_window")
        meta = await self.store.file(caller.tenant, input_file_id)
        content = await self.store.content(caller.tenant, input_file_id) if meta is not None else None
        if meta is None or content is None:
            raise NotFound(f"No such File object: {input_file_id[:64]}", reason="not_found", param="input_file_id")
        if meta.purpose != "batch":
            raise _bad("The input file's purpose must be 'batch'.", "input_file_id")
        lines = await asyncio.to_thread(parse_lines, content, self.limits.max_lines)
        now = self.store.now()
        batch = Batch(new_id("batch_"), caller, endpoint, input_file_id, completion_window, now,
                      now + WINDOWS[completion_window], len(lines), metadata=_check_metadata(metadata))
        await self.store.add_batch(batch)
        wrong = [line for line in lines if line.url != endpoint]
        if wrong:
            errors = [{"code": "mismatched_endpoint", "line": line.index + 1, "param": "url",
                       "message": f"The line's url is not the batch's endpoint {endpoint}."} for line in wrong[:100]]
            failed = await self.store.move(batch, "failed", errors=errors, counts={"completed": 0, "failed": 0})
            return (failed or batch).json({})
        started = await self.store.move(batch, "in_progress")
        await self._queue.push(batch.id, lines)
        return (started or batch).json({})

    async def batch(self, caller: Caller, batch_id: str) -> dict[str, Any]:
        batch = await self._owned(caller, batch_id)
        return batch.json(await self.store.counts(batch.id) if batch.counts is None else {})

    async def _owned(self, caller: Caller, batch_id: str) -> Batch:
        batch = await self.store.batch(batch_id, caller.tenant)
        if batch is None:
            raise NotFound(f"No such Batch object: {batch_id[:64]}", reason="not_found", param="batch_id")
        return batch

    async def batches(self, caller: Caller, after: str | None = None, limit: int | None = None) -> dict[str, Any]:
        found, more = await self.store.batches(caller.tenant, after, _page(limit))
        data = [b.json(await self.store.counts(b.id) if b.counts is None else {}) for b in found]
        return {"object": "list", "data": data, "has_more": more,
                "first_id": found[0].id if found else None, "last_id": found[-1].id if found else None}

    async def cancel(self, caller: Caller, batch_id: str) -> dict[str, Any]:
        """Lines not yet started are not run; those in flight finish; then ``cancelled``."""
        for _ in range(10):  # a batch that changed under us (a line's result, finalizing) is read again
            batch = await self._owned(caller, batch_id)
            if batch.status in ENDED or batch.status in ("cancelling", "finalizing"):
                if batch.status in ("completed", "failed", "expired"):
                    raise FailedPrecondition(f"Cannot cancel a batch that is {batch.status}.",
                                             reason="invalid_state")
                return batch.json(await self.store.counts(batch.id) if batch.counts is None else {})
            moved = await self.store.move(batch, "cancelling")
            if moved is not None:
                return moved.json(await self.store.counts(batch.id))
        raise FailedPrecondition("The batch is changing; retry.", reason="invalid_state")

    async def resume(self) -> int:
        """Pushes the lines not yet recorded of every open batch again (a one-machine gateway
        starting up: its in-process queue began empty). Returns how many lines."""
        pushed = 0
        for batch_id in await self.store.open_batches():
            batch = await self.store.batch(batch_id)
            raw = await self.store.content(batch.tenant, batch.input_file_id) if batch is not None else None
            if batch is None or raw is None or batch.status not in ("in_progress", "cancelling", "finalizing"):
                continue
            if batch.status == "finalizing":  # this process died finalizing it: its results are all there
                was = "cancelling" if batch.cancelling_at is not None else "in_progress"
                batch = await self.store.move(batch, was, **{f"{was}_at": getattr(batch, f"{was}_at")})
                if batch is None:
                    continue
            lines = await asyncio.to_thread(parse_lines, raw, self.limits.max_lines)
            todo = [line for line in lines if not await self.store.recorded(batch_id, line.index)]
            await self._queue.push(batch_id, todo or lines[-1:])  # all recorded: one line finishes it
            pushed += len(todo)
        return pushed


"""Files and batches over a ``Kv``, each visible to its tenant only: another tenant's id
reads as absent (the fronts answer 404)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from llmesh.gateway.domain.batches.kv import Kv
from llmesh.gateway.domain.batches.model import Batch, FileObject, new_id

OPEN_INDEX = "open"  # batches whose lines may still run, for a gateway that starts to take up again


class BatchStore:
    def __init__(self, kv: Kv, wall: Callable[[], float] = time.time):
        self._kv = kv
        self._wall = wall

    def now(self) -> int:
        return int(self._wall())

    async def add_file(self, tenant: str, filename: str, purpose: str, content: bytes) -> FileObject:
        meta = FileObject(new_id("file-"), tenant, len(content), self.now(), filename, purpose)
        await self._kv.put(f"content:{meta.id}", content)
        await self._kv.put(f"file:{meta.id}", meta.dumps())
        await self._kv.index_add(f"files:{tenant}", meta.id, int(self._wall() * 1e6))
        return meta

    async def file_count(self, tenant: str) -> int:
        return await self._kv.index_len(f"files:{tenant}")

    async def file(self, tenant: str, file_id: str) -> FileObject | None:
        raw = await self._kv.get(f"file:{file_id}")
        meta = FileObject.loads(raw) if raw is not None else None
        return meta if meta is not None and meta.tenant == tenant else None

    async def files(self, tenant: str, after: str | None, limit: int) -> tuple[list[FileObject], bool]:
        ids, more = await self._kv.index_page(f"files:{tenant}", after, limit)
        found = [await self.file(tenant, i) for i in ids]
        return [f for f in found if f is not None], more

    async def content(self, tenant: str, file_id: str) -> bytes | None:
        if await self.file(tenant, file_id) is None:
            return None
        return await self._kv.get(f"content:{file_id}")

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        if await self.file(tenant, file_id) is None:
            return False
        await self._kv.delete(f"file:{file_id}", f"content:{file_id}")
        await self._kv.index_remove(f"files:{tenant}", file_id)
        return True

    async def add_batch(self, batch: Batch) -> None:
        await self._kv.put(f"batch:{batch.id}", batch.dumps())
        await self._kv.index_add(f"batches:{batch.tenant}", batch.id, int(self._wall() * 1e6))
        await self._kv.index_add(OPEN_INDEX, batch.id, int(self._wall() * 1e6))

    async def batch(self, batch_id: str, tenant: str | None = None) -> Batch | None:
        """The batch; with ``tenant``, only when it is that tenant's."""
        raw = await self._kv.get(f"batch:{batch_id}")
        batch = Batch.loads(raw) if raw is not None else None
        return batch if batch is not None and tenant in (None, batch.tenant) else None

    async def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        ids, more = await self._kv.index_page(f"batches:{tenant}", after, limit)
        found = [await self.batch(i, tenant) for i in ids]
        return [b for b in found if b is not None], more

    async def move(self, batch: Batch, status: str, **fields: Any) -> Batch | None:
        """``batch`` moved to ``status``, when no one changed it since it was read; else None."""
        moved = batch.moved(status, self.now(), **fields)
        if not await self._kv.swap(f"batch:{batch.id}", batch.dumps(), moved.dumps()):
            return None
        if status not in ("in_progress", "cancelling", "finalizing"):
            await self._kv.index_remove(OPEN_INDEX, batch.id)
        return moved

    async def record(self, batch_id: str, index: int, kind: str, line: bytes) -> bool:
        """Line ``index``'s result (kind: completed, failed, expired, skipped); only the first
        one written for a line is kept. True when this one was."""
        return await self._kv.record(f"results:{batch_id}", str(index), kind, line)

    async def recorded(self, batch_id: str, index: int) -> bool:
        return await self._kv.recorded(f"results:{batch_id}", str(index))

    async def counts(self, batch_id: str) -> dict[str, int]:
        return await self._kv.counts(f"results:{batch_id}")

    async def results(self, batch_id: str) -> list[tuple[str, bytes]]:
        """(kind, line) per recorded line, in the input file's order."""
        held = await self._kv.results(f"results:{batch_id}")
        return [held[k] for k in sorted(held, key=int)]

    async def drop_results(self, batch_id: str) -> None:
        await self._kv.delete(f"results:{batch_id}")

    async def open_batches(self) -> list[str]:
        ids, _ = await self._kv.index_page(OPEN_INDEX, None, 10_000)
        return ids

"""Where the Batch API keeps its files and batches: a few key-value operations
(``Kv``) that a local directory (``DirKv``, one gateway process) and Redis
(``kv_redis.RedisKv``, any number of gateway workers) both give, each atomic on its own.

- blobs: ``get``, ``put``, ``delete``, ``swap`` (compare and set);
- results: ``record`` keeps one value per field, the first written (a line run twice is
  kept once), and counts the kinds recorded;
- indexes: members ordered by a score (microseconds since the epoch), paged newest first."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

import orjson


class Kv(Protocol):
    async def get(self, key: str) -> bytes | None: ...
    async def put(self, key: str, value: bytes) -> None: ...
    async def delete(self, *keys: str) -> None: ...
    async def swap(self, key: str, old: bytes, new: bytes) -> bool: ...
    async def record(self, key: str, field: str, kind: str, value: bytes) -> bool: ...
    async def recorded(self, key: str, field: str) -> bool: ...
    async def counts(self, key: str) -> dict[str, int]: ...
    async def results(self, key: str) -> dict[str, tuple[str, bytes]]: ...
    async def index_add(self, key: str, member: str, score: int) -> None: ...
    async def index_remove(self, key: str, member: str) -> None: ...
    async def index_page(self, key: str, after: str | None, limit: int) -> tuple[list[str], bool]: ...
    async def index_len(self, key: str) -> int: ...


def _write(path: Path, value: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(value)
    os.replace(tmp, path)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


class DirKv:
    """A directory, for one gateway process: blobs are files, a results set an append-only
    file of JSON lines (read back once), an index a JSON file. One lock serializes the
    changes (one process: no other writer)."""

    def __init__(self, root: Path):
        self._root = root
        self._lock = asyncio.Lock()
        self._results: dict[str, dict[str, tuple[str, bytes]]] = {}
        self._indexes: dict[str, dict[str, int]] = {}

    def _path(self, key: str, suffix: str = "") -> Path:
        self._root.mkdir(parents=True, exist_ok=True)
        return self._root / (quote(key, safe="") + suffix)

    async def get(self, key: str) -> bytes | None:
        return await asyncio.to_thread(_read, self._path(key))

    async def put(self, key: str, value: bytes) -> None:
        await asyncio.to_thread(_write, self._path(key), value)

    async def delete(self, *keys: str) -> None:
        async with self._lock:
            for key in keys:
                self._results.pop(key, None)
                for suffix in ("", ".results"):
                    self._path(key, suffix).unlink(missing_ok=True)

    async def swap(self, key: str, old: bytes, new: bytes) -> bool:
        async with self._lock:
            if _read(self._path(key)) != old:
                return False
            _write(self._path(key), new)
            return True

    def _loaded(self, key: str) -> dict[str, tuple[str, bytes]]:
        held = self._results.get(key)
        if held is None:
            held = self._results[key] = {}
            raw = _read(self._path(key, ".results")) or b""
            for line in raw.splitlines():
                try:
                    field, kind, value = orjson.loads(line)
                except (orjson.JSONDecodeError, ValueError):
                    continue  # a line cut short by a crash: that result is run again
                held.setdefault(field, (kind, value.encode()))
        return held

    async def record(self, key: str, field: str, kind: str, value: bytes) -> bool:
        async with self._lock:
            held = self._loaded(key)
            if field in held:
                return False
            with self._path(key, ".results").open("ab") as f:
                f.write(orjson.dumps([field, kind, value.decode()]) + b"\n")
            held[field] = (kind, value)
            return True

    async def recorded(self, key: str, field: str) -> bool:
        return field in self._loaded(key)

    async def counts(self, key: str) -> dict[str, int]:
        return dict(Counter(kind for kind, _ in self._loaded(key).values()))

    async def results(self, key: str) -> dict[str, tuple[str, bytes]]:
        return dict(self._loaded(key))

    def _index(self, key: str) -> dict[str, int]:
        index = self._indexes.get(key)
        if index is None:
            raw = _read(self._path(key, ".index"))
            index = self._indexes[key] = orjson.loads(raw) if raw else {}
        return index

    async def index_add(self, key: str, member: str, score: int) -> None:
        async with self._lock:
            self._index(key)[member] = score
            _write(self._path(key, ".index"), orjson.dumps(self._index(key)))

    async def index_remove(self, key: str, member: str) -> None:
        async with self._lock:
            if self._index(key).pop(member, None) is not None:
                _write(self._path(key, ".index"), orjson.dumps(self._index(key)))

    async def index_page(self, key: str, after: str | None, limit: int) -> tuple[list[str], bool]:
        ordered = sorted(self._index(key).items(), key=lambda kv: (-kv[1], kv[0]))
        members = [m for m, _ in ordered]
        start = members.index(after) + 1 if after in members else (len(members) if after else 0)
        return members[start:start + limit], start + limit < len(members)

    async def index_len(self, key: str) -> int:
        return len(self._index(key))

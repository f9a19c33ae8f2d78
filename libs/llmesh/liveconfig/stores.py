"""Where the config document lives. Both stores hand out (revision, text) pairs; the
services validate, so a bad document written behind the tools' back is still caught."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aetcd
import orjson
import watchfiles

from llmesh.errors import FailedPrecondition


@dataclass(frozen=True, slots=True)
class Version:
    revision: int
    text: str
    ts: float = 0.0


class ConfigStore(Protocol):
    address: str

    async def read(self) -> Version | None: ...
    def watch(self) -> AsyncIterator[Version]: ...
    async def write(self, text: str) -> int: ...
    async def history(self) -> list[Version]: ...


class FileStore:
    """A YAML file, watched. Its history is whatever keeps the file (git)."""

    def __init__(self, path: Path):
        self.path = path
        self.address = str(path)

    async def read(self) -> Version | None:
        try:
            st = self.path.stat()
            return Version(st.st_mtime_ns, self.path.read_text(), st.st_mtime)
        except FileNotFoundError:
            return None

    async def watch(self) -> AsyncIterator[Version]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        current = await self.read()
        if current is not None:
            yield current
        async for changes in watchfiles.awatch(self.path.parent, debounce=50, step=20, recursive=False):
            if any(self._touches(Path(p)) for _, p in changes):
                version = await self.read()
                if version is not None and version != current:
                    current = version
                    yield version

    def _touches(self, changed: Path) -> bool:
        """The file itself, or a mounted Kubernetes ConfigMap's update: the kubelet writes the new
        files into a fresh `..<timestamp>` directory and renames a `..data_tmp` symlink over
        `..data`; the file's own link (`llmesh.yaml -> ..data/llmesh.yaml`) never changes."""
        return changed in (self.path, self.path.resolve()) or changed.name.startswith("..")

    async def write(self, text: str) -> int:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text)
            tmp.replace(self.path)
        except OSError as exc:
            raise FailedPrecondition(
                f"the live config file {self.path} cannot be written ({exc.strerror or exc}); a mounted "
                "Kubernetes ConfigMap is read-only: edit the ConfigMap, or use LLMESH_CONFIG_BACKEND=etcd, "
                "where changes such as traffic splits can be written") from exc
        return self.path.stat().st_mtime_ns

    async def history(self) -> list[Version]:
        current = await self.read()
        return [current] if current else []


class EtcdStore:
    """``<prefix>/current`` holds the document; every write also leaves
    ``<prefix>/history/<revision>`` so any applied version can be read back."""

    def __init__(self, client: aetcd.Client, address: str, prefix: str = "/llmesh/config"):
        self._client = client
        self.address = address
        self._prefix = prefix.rstrip("/")
        self._current = f"{self._prefix}/current".encode()
        self._history = f"{self._prefix}/history/".encode()

    async def read(self) -> Version | None:
        got = await self._client.get(self._current)
        if got is None:
            return None
        return Version(got.mod_revision, got.value.decode())

    async def watch(self) -> AsyncIterator[Version]:
        watch = await self._client.watch(self._current)
        try:
            current = await self.read()
            if current is not None:
                yield current
            async for event in watch:
                if event.kind == "PUT" and (current is None or event.kv.mod_revision > current.revision):
                    current = Version(event.kv.mod_revision, event.kv.value.decode())
                    yield current
        finally:
            with contextlib.suppress(Exception):
                await watch.cancel()

    async def write(self, text: str) -> int:
        put = await self._client.put(self._current, text.encode())
        revision: int = put.header.revision
        await self._client.put(self._history + f"{revision:012d}".encode(),
                               orjson.dumps({"text": text, "ts": time.time()}))
        return revision

    async def history(self) -> list[Version]:
        out = []
        for kv in await self._client.get_prefix(self._history):
            data = orjson.loads(kv.value)
            out.append(Version(int(kv.key.rsplit(b"/", 1)[1]), data["text"], data["ts"]))
        return sorted(out, key=lambda v: v.revision)


async def first(store: ConfigStore, timeout_s: float) -> Version | None:
    """The current document, or TimeoutError/ConnectionError if the store is away."""
    return await asyncio.wait_for(store.read(), timeout_s)

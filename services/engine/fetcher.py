"""Engines get models without a filesystem shared with the model manager: when LoadModel
names a model, the fetcher asks the model manager for its manifest (every file of the
version: relative path, sha256, size), and downloads each file that is not already in
place with that digest into ``<model_dir>/.partial/<sha256>.part`` (a cut download
resumes from the partial file's size), checks its sha256, renames it into
``<model_dir>/<name>/<path>`` and writes ``model.json`` last. A folder shared with the
model manager (a shared volume, ``llmesh up``) already holds the files: nothing moves.

Bounded: the model's total size (``max_bytes``) and the disk's free space are checked
before a byte is written, a stream that sends nothing for ``idle_timeout_s`` is cut and
resumed (``attempts`` per file), and the whole fetch has a deadline. A digest that
differs is an error and the partial file is removed. Pure: the model manager comes in
through ``ArtifactSource`` (gRPC: llmesh.engine.modelsource)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Protocol

from llmesh.errors import (DeadlineExceeded, Internal, InvalidArgument, LlmeshError, NotFound, ResourceExhausted,
                           Unavailable)
from llmesh.modelstore import FORMATS, HEX_DIGITS, MANIFEST, SIDECAR, ManifestFile, cached_sha256

log = logging.getLogger("llmesh.engine.fetcher")

PARTIAL_DIR = ".partial"
HEX = HEX_DIGITS
MAX_PATH = 512
MAX_METADATA = 1 << 20


RemoteFile = ManifestFile  # what the model manager lists: llmesh.modelstore's


@dataclass(frozen=True, slots=True)
class RemoteManifest:
    served_name: str
    files: tuple[RemoteFile, ...]
    metadata_json: str


class ArtifactSource(Protocol):
    async def manifest(self, name: str) -> RemoteManifest: ...
    # (offset, data, blob size) from ``offset`` on; closing the generator ends the download
    def chunks(self, sha256: str, offset: int) -> AsyncGenerator[tuple[int, bytes, int], None]: ...


@dataclass(frozen=True, slots=True)
class FetchLimits:
    max_bytes: int = 64 << 30
    max_files: int = 1024
    timeout_s: float = 3600.0
    idle_timeout_s: float = 30.0
    attempts: int = 5
    free_margin_bytes: int = 64 << 20  # left free on the disk after the fetch


@dataclass(frozen=True, slots=True)
class FetchResult:
    name: str
    files: int
    downloaded_bytes: int  # received over the network in this fetch
    resumed_bytes: int     # already held by partial files from an earlier, cut fetch
    reused_files: int      # already in place with the right digest (a shared folder, a second load)


class FetchFailed(Internal):
    """The model manager sent something other than what its manifest promised."""


_RETRIED = (Unavailable, ResourceExhausted, DeadlineExceeded, TimeoutError)


class ModelFetcher:
    def __init__(self, model_dir: Path, source: ArtifactSource, limits: FetchLimits = FetchLimits(),
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self._dir = model_dir
        self._source = source
        self.limits = limits
        self._sleep = sleep
        self._lock = asyncio.Lock()  # one fetch at a time: two loads never write one partial file

    @property
    def partial_dir(self) -> Path:
        return self._dir / PARTIAL_DIR

    async def ensure(self, name: str) -> FetchResult | None:
        """Makes ``<model_dir>/<name>`` hold the model manager's files for ``name``. None
        when the model manager does not serve it (a model of the engine's own) or is away
        while a local copy exists: the load goes on with what is local."""
        _check_name(name)
        async with self._lock:
            try:
                async with asyncio.timeout(self.limits.timeout_s):
                    return await self._ensure(name)
            except TimeoutError:
                raise DeadlineExceeded(f"fetching {name} took over {self.limits.timeout_s:g} s "
                                       "(fetch_timeout_s); what arrived is kept and the next load resumes") from None

    async def _ensure(self, name: str) -> FetchResult | None:
        folder = self._dir / name
        local = folder.is_dir() and any(p.suffix in FORMATS or p.name == "config.json" for p in folder.iterdir())
        try:
            manifest = await asyncio.wait_for(self._source.manifest(name), self.limits.idle_timeout_s)
        except NotFound:
            return None  # not deployed through the model manager: the build finds it locally, or says NOT_FOUND
        except _RETRIED as exc:
            if not local:
                raise Unavailable(f"{name} is not in this engine's model store and the model manager cannot be "
                                  f"asked for it: {_why(exc)}") from None
            log.warning("model manager unreachable; loading the local copy", extra={"model": name,
                                                                                     "error": _why(exc)})
            return None
        files = self._checked(name, manifest)
        started = time.monotonic()
        missing = []
        for f in files:
            if not await asyncio.to_thread(_in_place, folder / f.path, f):
                missing.append(f)
        if missing:
            await asyncio.to_thread(self._check_space, missing)
        downloaded = resumed = 0
        for f in missing:
            part, got, had = await self._download(name, f)
            await asyncio.to_thread(_place, part, folder / f.path, f)
            downloaded, resumed = downloaded + got, resumed + had
        await asyncio.to_thread(_settle_folder, folder, files, manifest.metadata_json, bool(missing))
        result = FetchResult(name, len(files), downloaded, resumed, len(files) - len(missing))
        if missing:
            log.info("model fetched", extra={"model": name, "files": len(files), "bytes": downloaded,
                                             "resumed_bytes": resumed, "reused_files": result.reused_files,
                                             "ms": round((time.monotonic() - started) * 1000)})
        return result

    def _checked(self, name: str, m: RemoteManifest) -> list[RemoteFile]:
        if m.served_name != name:
            raise FetchFailed(f"asked for the manifest of {name}, the model manager sent {m.served_name}'s")
        if not 1 <= len(m.files) <= self.limits.max_files:
            raise FetchFailed(f"{name}: the manifest lists {len(m.files)} files (1 to {self.limits.max_files})")
        if len(m.metadata_json) > MAX_METADATA:
            raise FetchFailed(f"{name}: model.json is {len(m.metadata_json)} bytes (at most {MAX_METADATA})")
        seen: set[str] = set()
        for f in m.files:
            _check_path(name, f.path)
            if len(f.sha256) != 64 or not set(f.sha256) <= HEX or f.size_bytes < 0:
                raise FetchFailed(f"{name}: {f.path} has no valid sha256 and size")
            parents = {str(p) for p in PurePosixPath(f.path).parents}
            if f.path in seen or parents & seen or any(s.startswith(f.path + "/") for s in seen):
                raise FetchFailed(f"{name}: {f.path} is listed twice, or as a file and a folder")
            seen.add(f.path)
        total = sum(f.size_bytes for f in m.files)
        if total > self.limits.max_bytes:
            raise ResourceExhausted(f"{name} is {total} bytes, more than this engine fetches "
                                    f"(fetch_max_bytes {self.limits.max_bytes})", reason="model_too_large")
        return list(m.files)

    def _check_space(self, missing: list[RemoteFile]) -> None:
        self.partial_dir.mkdir(parents=True, exist_ok=True)
        held = sum(_size(self.partial_dir / f"{f.sha256}.part") for f in missing)
        need = sum(f.size_bytes for f in missing) - held + self.limits.free_margin_bytes
        free = shutil.disk_usage(self.partial_dir).free
        if need > free:
            raise ResourceExhausted(f"fetching needs {need} bytes on {self._dir}, {free} are free",
                                    reason="disk_full")

    async def _download(self, name: str, f: RemoteFile) -> tuple[Path, int, int]:
        """The verified partial file, the bytes received now and those held before."""
        part = self.partial_dir / f"{f.sha256}.part"
        got = _Progress(*await asyncio.to_thread(_rehash, part, f.size_bytes))
        held, failures = got.have, 0
        while True:
            try:
                await self._stream(name, f, part, got)
                break
            except FetchFailed:
                part.unlink(missing_ok=True)
                raise
            except _RETRIED as exc:
                failures += 1
                if failures >= self.limits.attempts:
                    raise Unavailable(f"fetching {f.path} of {name} failed {failures} times (last: {_why(exc)}); "
                                      f"{got.have} of {f.size_bytes} bytes are kept and the next load resumes"
                                      ) from None
                log.warning("fetch interrupted; resuming", extra={"model": name, "file": f.path,
                                                                 "from_byte": got.have, "error": _why(exc)})
                await self._sleep(min(5.0, 0.25 * 2 ** failures))
        if got.hash.hexdigest() != f.sha256:
            part.unlink(missing_ok=True)
            raise FetchFailed(f"{name}: {f.path} arrived with sha256 {got.hash.hexdigest()}, the registry says "
                              f"{f.sha256}; the download was removed", reason="checksum_mismatch")
        return part, got.have - held, held

    async def _stream(self, name: str, f: RemoteFile, part: Path, got: _Progress) -> None:
        """Appends one stream's chunks to the partial file; ``got`` follows every byte written."""
        chunks = self._source.chunks(f.sha256, got.have)
        out = await asyncio.to_thread(part.open, "ab")
        try:
            while True:
                try:
                    offset, data, size = await asyncio.wait_for(anext(chunks), self.limits.idle_timeout_s)
                except StopAsyncIteration:
                    break
                if size != f.size_bytes or offset != got.have or got.have + len(data) > f.size_bytes:
                    raise FetchFailed(f"{name}: {f.path}: got bytes {offset}..{offset + len(data)} of {size}, "
                                      f"expected from {got.have} of {f.size_bytes}")
                await asyncio.to_thread(_append, out, got.hash, data)
                got.have += len(data)
        finally:
            await chunks.aclose()  # ends the call if we stop early
            await asyncio.to_thread(out.close)
        if got.have != f.size_bytes:
            raise Unavailable(f"the stream ended at byte {got.have} of {f.size_bytes}")


class _Progress:
    """A partial file's hash and length, as far as written."""

    def __init__(self, h: hashlib._Hash, have: int):
        self.hash = h
        self.have = have


def _why(exc: BaseException) -> str:
    if isinstance(exc, LlmeshError):
        return exc.message
    return type(exc).__name__ if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"


def _check_name(name: str) -> None:
    if not name or len(name) > 256 or "/" in name or "\\" in name or "\0" in name or name.startswith("."):
        raise InvalidArgument(f"{name[:80]!r} is not a model name", param="name")


def _check_path(name: str, path: str) -> None:
    p = PurePosixPath(path)
    if (not path or len(path) > MAX_PATH or "\\" in path or "\0" in path or p.is_absolute()
            or any(part in ("", ".", "..") or part.startswith(".") for part in path.split("/"))
            or p.name == MANIFEST or p.name.endswith(SIDECAR)):
        raise FetchFailed(f"{name}: the manifest names a path an engine does not write: {path[:120]!r}")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _rehash(part: Path, size: int) -> tuple[hashlib._Hash, int]:
    """The hash of what a partial file holds and its length; a file longer than the blob is dropped."""
    h = hashlib.sha256()
    if _size(part) > size:
        part.unlink()
    if not part.exists():
        return h, 0
    have = 0
    with part.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            have += len(block)
    return h, have


def _append(out: IO[bytes], h: hashlib._Hash, data: bytes) -> None:
    out.write(data)
    h.update(data)


def _in_place(target: Path, f: RemoteFile) -> bool:
    try:
        return target.is_file() and target.stat().st_size == f.size_bytes and cached_sha256(target) == f.sha256
    except OSError:
        return False


def _place(part: Path, target: Path, f: RemoteFile) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, target)
    st = target.stat()
    # the digest is known: ModelStore and the next fetch need not read the file again
    target.with_name(target.name + SIDECAR).write_text(f"{f.sha256} {st.st_size}:{st.st_mtime_ns}\n")


def _settle_folder(folder: Path, files: list[RemoteFile], metadata_json: str, changed: bool) -> None:
    """Drops artifacts of an earlier variant (the store loads the folder's artifact) and
    writes model.json last; a folder already right (a read-only shared one) is left alone."""
    keep = {f.path for f in files}
    for old in folder.iterdir():
        if old.is_file() and old.suffix in FORMATS and old.name not in keep:
            old.unlink()
            old.with_name(old.name + SIDECAR).unlink(missing_ok=True)
            changed = True
    manifest = folder / MANIFEST
    text = metadata_json or json.dumps({"files": [{"path": f.path, "sha256": f.sha256, "size": f.size_bytes}
                                                  for f in files]}) + "\n"
    if changed or not manifest.is_file() or manifest.read_text() != text:
        tmp = folder / f".{MANIFEST}.tmp"
        tmp.write_text(text)
        os.replace(tmp, manifest)

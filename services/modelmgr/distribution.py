"""What engines fetch from the model manager, so that no filesystem is shared with them:
the manifest of a deployed model (the files of the folder ``Deploy`` published, each a
blob of the artifact store named by its sha256) and a blob's bytes from an offset, in
chunks. Pure: no gRPC (the servicer streams what ``chunks`` yields).

The manifest is a list of (relative path, sha256, size): the published ``model.json``'s
``files`` when it names them, else every file of the published folder (its sidecars
and ``model.json`` aside), so a multi-file version (safetensors shards, configs,
tokenizer) is served like a single GGUF."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from llmesh.errors import InvalidArgument, NotFound, ResourceExhausted
from llmesh.modelstore import HEX_DIGITS, MANIFEST, SIDECAR, ManifestFile, cached_sha256

log = logging.getLogger("llmesh.modelmgr.distribution")

CHUNK_BYTES = 1 << 20
HEX = HEX_DIGITS


@dataclass(frozen=True, slots=True)
class Manifest:
    served_name: str
    files: tuple[ManifestFile, ...]
    metadata_json: str  # the published model.json, as written


def check_sha256(value: str) -> str:
    if len(value) != 64 or not set(value) <= HEX:
        raise InvalidArgument(f"sha256 must be 64 lowercase hex digits, got {value[:80]!r}", param="sha256")
    return value


def check_served_name(name: str) -> str:
    if not name or len(name) > 256 or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
        raise InvalidArgument(f"{name[:80]!r} is not a served model name (NAME@VERSION)", param="served_name")
    return name


class ArtifactServer:
    """Reads the model manager's published folders and artifact blobs for engines."""

    def __init__(self, model_dir: Path, blob_path: Callable[[str], Path], max_streams: int = 8,
                 chunk_bytes: int = CHUNK_BYTES, on_sent: Callable[[int], None] = lambda n: None):
        self._model_dir = model_dir
        self._blob_path = blob_path  # ArtifactStore.blob_path
        self._chunk = chunk_bytes
        self._on_sent = on_sent      # bytes handed to a download (a metric)
        self._max_streams = max_streams
        self._streams = 0

    # --- manifest -------------------------------------------------------
    def manifest(self, served_name: str) -> Manifest:
        """Blocking (reads the folder, may hash a file without a sidecar): run it in a thread."""
        folder = self._model_dir / check_served_name(served_name)
        if not folder.is_dir():
            raise NotFound(f"{served_name} is not deployed on this model manager "
                           "(`llmesh models deploy NAME:VERSION` publishes a version)", reason="not_deployed")
        text = (folder / MANIFEST).read_text() if (folder / MANIFEST).is_file() else ""
        metadata = json.loads(text) if text else {}
        listed = metadata.get("files") if isinstance(metadata, dict) else None
        files = tuple(_listed(listed)) if isinstance(listed, list) else tuple(_walk(folder))
        if not files:
            raise NotFound(f"{served_name} has no artifact files at {folder}")
        for f in files:
            if not self._blob_path(f.sha256).is_file():
                raise NotFound(f"{served_name}: {f.path} ({f.sha256}) is not in the artifact store; import it again")
        return Manifest(served_name, files, text)

    # --- blobs ------------------------------------------------------------
    async def chunks(self, sha256: str, offset: int) -> AsyncIterator[tuple[int, bytes, int]]:
        """(offset, data, blob size) from ``offset`` to the end of the blob ``sha256``."""
        path = self._blob_path(check_sha256(sha256))
        if not path.is_file():
            raise NotFound(f"no artifact {sha256} in this model manager's store")
        if self._streams >= self._max_streams:
            raise ResourceExhausted(f"{self._streams} artifact downloads are in progress (at most "
                                    f"{self._max_streams}); retry shortly", reason="fetch_busy")
        self._streams += 1
        try:
            f = await asyncio.to_thread(path.open, "rb")
            try:
                size = os.fstat(f.fileno()).st_size
                if offset > size:
                    raise InvalidArgument(f"offset {offset} is past the end of {sha256} ({size} bytes)",
                                          param="offset")
                await asyncio.to_thread(f.seek, offset)
                if offset == size:
                    yield offset, b"", size  # the caller holds it all: one empty chunk says the size
                while offset < size:
                    data = await asyncio.to_thread(f.read, min(self._chunk, size - offset))
                    if not data:
                        raise NotFound(f"artifact {sha256} shrank while being read")
                    yield offset, data, size
                    self._on_sent(len(data))
                    offset += len(data)
            finally:
                await asyncio.to_thread(f.close)
        finally:
            self._streams -= 1


def _listed(entries: list[Any]) -> list[ManifestFile]:
    """model.json's ``files``: [{"path", "sha256", "size"}]."""
    out = []
    for e in entries:
        if not isinstance(e, dict) or not {"path", "sha256", "size"} <= set(e):
            raise NotFound(f"{MANIFEST} lists a file without path, sha256 and size: {str(e)[:120]}")
        out.append(ManifestFile(str(e["path"]), check_sha256(str(e["sha256"])), int(e["size"])))
    return out


def _walk(folder: Path) -> list[ManifestFile]:
    """Every file under ``folder`` but model.json and the sidecars, with its digest (the
    sidecar's when it is current, else computed)."""
    out = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = PurePosixPath(path.relative_to(folder).as_posix())
        if rel.name == MANIFEST or rel.name.endswith(SIDECAR) or any(part.startswith(".") for part in rel.parts):
            continue
        out.append(ManifestFile(str(rel), cached_sha256(path), path.stat().st_size))
    return out

"""The model store on disk: one folder per model holding its artifact (a .gguf or
.safetensors file) and an optional ``model.json`` manifest with its lineage.

    <model_dir>/<name>/<artifact>
    <model_dir>/<name>/model.json      {"source": ..., "context_length": ...}

Checksums are computed once and kept beside the artifact, keyed by size and mtime."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llmesh.errors import ModelNotFound

log = logging.getLogger("llmesh.modelstore")

FORMATS = {".gguf": "gguf", ".safetensors": "safetensors"}
MANIFEST = "model.json"
SIDECAR = ".sha256"  # beside a weights file: its digest, size and mtime (``cached_sha256``)
HEX_DIGITS = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class ManifestFile:
    """One file of a published version, as the model manager lists it and an engine fetches it."""
    path: str          # relative, '/'-separated
    sha256: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class ModelRecord:
    name: str
    format: str
    size_bytes: int
    sha256: str
    context_length: int
    path: Path
    source: str


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cached_sha256(path: Path) -> str:
    """The file's sha256, from its ``.sha256`` sidecar when that is current (same size and
    mtime), else computed and kept there."""
    st = path.stat()
    return ModelStore.checksum(path, st.st_size, st.st_mtime_ns)


@contextlib.contextmanager
def quiet_native_fd(fd: int) -> Iterator[None]:
    """llama.cpp prints straight to fd 1 or 2 (loader chatter, a line per quantized
    tensor); our output there is JSON only."""
    (sys.stdout if fd == 1 else sys.stderr).flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)


def quiet_native_stderr() -> contextlib.AbstractContextManager[None]:
    return quiet_native_fd(2)


def gguf_context_length(path: Path) -> int:
    """The trained context length from a GGUF file's metadata (0 if absent). Reads
    the vocabulary only (~0.2 s); the gguf package's pure-Python reader takes ~5 s."""
    from llama_cpp import Llama

    with quiet_native_stderr():
        llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        arch = llm.metadata.get("general.architecture", "")
        return int(llm.metadata.get(f"{arch}.context_length", 0))
    finally:
        llm.close()


class ModelStore:
    def __init__(self, root: Path):
        self.root = root
        self._cache: dict[tuple[str, int, int], ModelRecord] = {}

    def list(self) -> list[ModelRecord]:
        if not self.root.is_dir():
            return []
        records = []
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            record = self.get(folder.name)
            if record is not None:
                records.append(record)
        return records

    def gguf(self, name: str) -> Path:
        """The GGUF file of model ``name``; ModelNotFound when the store has no GGUF of that name."""
        record = self.get(name)
        if record is None or record.format != "gguf":
            raise ModelNotFound(name)
        return record.path

    def get(self, name: str) -> ModelRecord | None:
        folder = self.root / name
        if "/" in name or not folder.is_dir():
            return None
        artifact = next((p for p in sorted(folder.iterdir()) if p.suffix in FORMATS and p.is_file()), None)
        if artifact is None:
            return None
        st = artifact.stat()
        key = (str(artifact), st.st_size, st.st_mtime_ns)
        if key not in self._cache:
            self._cache[key] = self._describe(name, artifact, st.st_size, st.st_mtime_ns)
        return self._cache[key]

    def _describe(self, name: str, artifact: Path, size: int, mtime_ns: int) -> ModelRecord:
        manifest = {}
        if (artifact.parent / MANIFEST).is_file():
            manifest = json.loads((artifact.parent / MANIFEST).read_text())
        fmt = FORMATS[artifact.suffix]
        context_length = int(manifest.get("context_length") or 0)
        if not context_length and fmt == "gguf":
            context_length = gguf_context_length(artifact)
        return ModelRecord(name=name, format=fmt, size_bytes=size,
                           sha256=self.checksum(artifact, size, mtime_ns),
                           context_length=context_length, path=artifact,
                           source=str(manifest.get("source", "")))

    @staticmethod
    def checksum(artifact: Path, size: int, mtime_ns: int) -> str:
        sidecar = artifact.with_name(artifact.name + SIDECAR)
        stamp = f"{size}:{mtime_ns}"
        if sidecar.is_file():
            digest, _, seen = sidecar.read_text().strip().partition(" ")
            if seen == stamp:
                return digest
        digest = sha256_file(artifact)
        try:
            sidecar.write_text(f"{digest} {stamp}\n")
        except OSError:
            log.warning("cannot write checksum sidecar", extra={"path": str(sidecar)})
        return digest

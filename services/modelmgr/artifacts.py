"""The artifact store: blobs named by their sha256 (content-addressed), imported from
a local path, an HTTP(S) URL (resumable) or an installed Python package, checked
against the digest the caller expects; and published into the engines' model store
under the name a version is served by.

    <store>/blobs/sha256/<hex>        the artifact, read-only
    <store>/partial/<key>.part        a download in progress (resumed with Range)
    <model_dir>/<name@N>/<file>       a hard link (or symlink) to the blob, for engines
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx

from llmesh.errors import InvalidArgument, NotFound, Unavailable
from llmesh.modelstore import FORMATS

log = logging.getLogger("llmesh.modelmgr.artifacts")

Progress = Callable[[int, int], None]  # (bytes done, bytes total or 0 when unknown)
CHUNK = 1 << 20


class ChecksumMismatch(InvalidArgument):
    def __init__(self, source: str, expected: str, actual: str):
        super().__init__(f"{source}: sha256 is {actual}, expected {expected}; the artifact was rejected",
                         reason="checksum_mismatch", param="sha256")


@dataclass(frozen=True, slots=True)
class Blob:
    sha256: str
    size_bytes: int
    path: Path
    format: str
    filename: str  # the name it came with (kept when published)


def _format_of(name: str) -> str:
    fmt = FORMATS.get(Path(name).suffix)
    if fmt is None:
        raise InvalidArgument(f"{name}: not a model artifact (one of {sorted(FORMATS)})", param="source")
    return fmt


def _check_digest(expected: str) -> str:
    expected = expected.strip().lower()
    if expected and (len(expected) != 64 or any(c not in "0123456789abcdef" for c in expected)):
        raise InvalidArgument(f"sha256 must be 64 hex digits, got {expected!r}", param="sha256")
    return expected


class ArtifactStore:
    def __init__(self, root: Path, model_dir: Path, http_timeout_s: float = 30.0):
        self.root = root
        self.model_dir = model_dir
        self._timeout = http_timeout_s

    def blob_path(self, sha256: str) -> Path:
        return self.root / "blobs" / "sha256" / sha256

    def has(self, sha256: str) -> bool:
        return self.blob_path(sha256).is_file()

    # --- import ---------------------------------------------------------
    def import_source(self, source: str, expected_sha256: str = "", progress: Progress | None = None) -> Blob:
        """``source``: a local path, ``http(s)://...`` or ``package:DIST[/member]``."""
        expected = _check_digest(expected_sha256)
        scheme = urlparse(source).scheme
        if scheme in ("http", "https"):
            return self._download(source, expected, progress)
        if source.startswith("package:"):
            return self._copy(self._package_member(source.removeprefix("package:")), expected, progress,
                              label=source)
        if scheme not in ("", "file"):
            raise InvalidArgument(f"unsupported source {source!r}: a path, http(s):// URL or package:DIST",
                                  param="source")
        path = Path(urlparse(source).path if scheme == "file" else source)
        if not path.is_file():
            raise NotFound(f"no file at {path}")
        return self._copy(path, expected, progress, label=str(path))

    def add_file(self, path: Path, filename: str) -> Blob:
        """Takes in a file this service made (a quantized variant), moving it."""
        digest = _hash_file(path)
        return self._settle(path, digest, path.stat().st_size, _format_of(filename), filename, move=True)

    def _copy(self, path: Path, expected: str, progress: Progress | None, label: str) -> Blob:
        fmt = _format_of(path.name)
        total = path.stat().st_size
        tmp = self._tmp(f"copy-{os.getpid()}-{path.name}")
        h = hashlib.sha256()
        done = 0
        with path.open("rb") as src, tmp.open("wb") as dst:
            while block := src.read(CHUNK):
                h.update(block)
                dst.write(block)
                done += len(block)
                if progress:
                    progress(done, total)
        return self._verify_and_settle(tmp, h.hexdigest(), expected, total, fmt, path.name, label)

    def _download(self, url: str, expected: str, progress: Progress | None) -> Blob:
        filename = Path(urlparse(url).path).name
        fmt = _format_of(filename)
        key = hashlib.sha256(url.encode()).hexdigest()[:24]
        part = self._tmp(f"{key}.part", keep=True)
        h = hashlib.sha256()
        have = 0
        if part.exists():  # resume: rehash what we have, ask for the rest
            with part.open("rb") as f:
                while block := f.read(CHUNK):
                    h.update(block)
                    have += len(block)
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            with httpx.stream("GET", url, headers=headers, timeout=self._timeout, follow_redirects=True) as resp:
                if resp.status_code == 416 and have:  # we hold it all already
                    total = have
                else:
                    if resp.status_code == 200 and have:  # no range support: start over
                        h, have = hashlib.sha256(), 0
                        part.unlink()
                    elif resp.status_code not in (200, 206):
                        raise NotFound(f"{url}: HTTP {resp.status_code}") if resp.status_code == 404 else \
                            Unavailable(f"{url}: HTTP {resp.status_code}")
                    length = int(resp.headers.get("content-length", 0))
                    total = have + length if length else 0
                    if have:
                        log.info("resuming download", extra={"url": url, "from_byte": have})
                    with part.open("ab") as out:
                        for block in resp.iter_bytes():  # as received: a cut keeps what arrived
                            h.update(block)
                            out.write(block)
                            have += len(block)
                            if progress:
                                progress(have, total)
                    total = have
        except httpx.HTTPError as exc:
            raise Unavailable(f"{url}: download interrupted after {have} bytes ({type(exc).__name__}); "
                              "import again to resume") from exc
        return self._verify_and_settle(part, h.hexdigest(), expected, total, fmt, filename, url)

    def _verify_and_settle(self, tmp: Path, digest: str, expected: str, size: int, fmt: str, filename: str,
                           label: str) -> Blob:
        if expected and digest != expected:
            tmp.unlink(missing_ok=True)
            raise ChecksumMismatch(label, expected, digest)
        return self._settle(tmp, digest, size, fmt, filename, move=True)

    def _settle(self, tmp: Path, digest: str, size: int, fmt: str, filename: str, move: bool) -> Blob:
        blob = self.blob_path(digest)
        if blob.is_file():
            tmp.unlink(missing_ok=True)  # same content already stored
        else:
            blob.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, blob)
            blob.chmod(0o444)
        return Blob(digest, size, blob, fmt, filename)

    def _tmp(self, name: str, keep: bool = False) -> Path:
        d = self.root / "partial"
        d.mkdir(parents=True, exist_ok=True)
        path = d / name
        if not keep:
            path.unlink(missing_ok=True)
        return path

    @staticmethod
    def _package_member(spec: str) -> Path:
        """``DIST`` or ``DIST/path/inside``: an artifact file installed by a Python package."""
        dist_name, _, member = spec.partition("/")
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise NotFound(f"the package {dist_name!r} is not installed") from None
        files = [f for f in dist.files or () if Path(str(f)).suffix in FORMATS]
        if member:
            files = [f for f in files if str(f) == member]
        if len(files) != 1:
            raise NotFound(f"package {dist_name!r} holds {len(files)} matching artifacts "
                           f"({[str(f) for f in files]}); name one as package:{dist_name}/PATH")
        return Path(str(dist.locate_file(files[0])))

    # --- publish for engines -------------------------------------------
    def publish(self, served: str, sha256: str, filename: str, manifest: dict) -> Path:
        """Makes a blob loadable as ``served`` by engines sharing ``model_dir``."""
        blob = self.blob_path(sha256)
        if not blob.is_file():
            raise NotFound(f"artifact {sha256} is not in the store at {self.root}")
        folder = self.model_dir / served
        target = folder / filename
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            if old != target and old.suffix in FORMATS:
                old.unlink()  # an earlier variant of the same version
        if not target.exists():
            try:
                os.link(blob, target)
            except OSError:
                target.symlink_to(blob)
        st = target.stat()
        # The digest is known: spare ModelStore re-reading the file.
        target.with_name(target.name + ".sha256").write_text(f"{sha256} {st.st_size}:{st.st_mtime_ns}\n")
        (folder / "model.json").write_text(json.dumps(manifest, indent=2) + "\n")
        return target

    def unpublish(self, served: str) -> None:
        shutil.rmtree(self.model_dir / served, ignore_errors=True)


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()

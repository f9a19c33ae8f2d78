"""Hugging Face safetensors directories as model versions (what vLLM loads): every file
a content-addressed blob of the artifact store, and a manifest, itself a blob, listing
them. The manifest's sha256 is the version's artifact digest, so a directory is named by
its content as a single GGUF file is (the same files give the same digest).

    manifest: {"format": "safetensors",
               "files": [{"path": "config.json", "sha256": HEX, "size": N}, ...]}   sorted by path

An import is refused before anything is copied unless the directory is one vLLM can load
and the store can hold: config.json present, a JSON object naming the architecture; at
least one .safetensors file whose header parses and whose tensors lie inside it; the
shards a model.safetensors.index.json names all present; no file that is a link out of
the directory, a symlinked directory or a special file (a FIFO would hang the import);
at most ``max_files`` files, ``max_depth`` folders deep, ``max_bytes`` in all. Hidden
entries (``.cache/``, ``.gitattributes``) are left out. Publishing links every file
into ``<model_dir>/<name@N>/`` as a GGUF version's single file is."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from llmesh.errors import InvalidArgument, NotFound
from llmesh.modelmgr.artifacts import CHUNK, ArtifactStore, ChecksumMismatch, Progress
from llmesh.modelmgr.registry import Artifact
from llmesh.modelstore import SIDECAR

FORMAT = "safetensors"
SUFFIX = ".safetensors"
MODEL_JSON = "model.json"            # what publish writes beside the files (lineage for engines)
MAX_CONFIG_BYTES = 1 << 20           # config.json, tokenizer_config.json, the shard index
MAX_HEADER_BYTES = 100 << 20         # a safetensors header (safetensors' own limit)
MAX_MANIFEST_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class DirLimits:
    max_files: int = 1000
    max_bytes: int = 1 << 40
    max_depth: int = 4


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """One file of a version: where it goes (relative, '/'-separated) and which blob it is."""
    path: str
    sha256: str
    size: int


@dataclass(frozen=True, slots=True)
class DirVersion:
    """An imported directory: its manifest blob and what its config says."""
    sha256: str                      # the manifest's
    size_bytes: int                  # the files'
    files: tuple[ManifestEntry, ...]
    context_length: int
    tokenizer: str
    quantization: str                # quant_method, else the weights' dtype


def is_directory_source(source: str) -> bool:
    path = source.removeprefix("file://")
    return "://" not in path and not path.startswith("package:") and Path(path).is_dir()


def is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def _bad(path: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"{path}: {why}", param="source", reason="invalid_model_directory")


# --- scanning ---------------------------------------------------------------
def scan(root: Path, limits: DirLimits) -> list[tuple[str, Path, int]]:
    """(relative path, file, size) of every file to import, sorted; refuses as soon as a
    bound is passed (folders count against the file bound too), so a huge or hostile tree
    costs bounded time."""
    try:
        top = root.resolve(strict=True)
    except OSError as exc:
        raise NotFound(f"no directory at {root} ({exc.strerror})") from None
    label = str(root)

    def unreadable(exc: OSError) -> None:
        raise _bad(label, f"{exc.filename} cannot be read ({exc.strerror})")

    found: list[tuple[str, Path, int]] = []
    total = folders = 0
    for folder, dirs, files in os.walk(top, onerror=unreadable, followlinks=False):
        rel_folder = Path(folder).relative_to(top)
        if len(rel_folder.parts) > limits.max_depth:
            raise _bad(label, f"{rel_folder} is more than {limits.max_depth} folders deep")
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        folders += len(dirs)
        for d in dirs:
            if (Path(folder) / d).is_symlink():
                raise _bad(label, f"{rel_folder / d} is a symlinked directory; copy it in (cp -rL)")
        # checksum sidecars are llmesh's own digest cache (ModelStore writes them beside weights it
        # read, e.g. when an engine served this folder): derived data, left out, never imported
        for name in sorted(f for f in files if not f.startswith(".") and not f.endswith(SIDECAR)):
            rel = (rel_folder / name).as_posix()
            path, size = _regular_file(top, Path(folder) / name, rel, label)
            total += size
            found.append((rel, path, size))
            if total > limits.max_bytes:
                raise _bad(label, f"more than {limits.max_bytes} bytes (LLMESH_MODELMGR_IMPORT_MAX_BYTES)")
        if len(found) + folders > limits.max_files:
            raise _bad(label, f"more than {limits.max_files} files and folders (LLMESH_MODELMGR_IMPORT_MAX_FILES)")
    return sorted(found)


def _regular_file(top: Path, path: Path, rel: str, label: str) -> tuple[Path, int]:
    """The file a directory entry is (a link followed, inside the directory only) and its size."""
    check_relative(rel)
    if rel == MODEL_JSON:
        raise _bad(label, f"{rel}: the name is reserved for what the model manager writes beside a version")
    target = path.resolve()
    if not target.is_relative_to(top):
        raise _bad(label, f"{rel} links outside the directory (to {target}); copy the files in (cp -L)")
    try:
        st = target.stat()
    except OSError as exc:
        raise _bad(label, f"{rel} cannot be read ({exc.strerror}; a broken link?)") from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(label, f"{rel} is not a regular file")
    return target, st.st_size


def check_relative(rel: str) -> str:
    """A manifest path: relative, '/'-separated, no '.', '..' or empty part, printable."""
    p = PurePosixPath(rel)
    if (not rel or p.is_absolute() or rel != p.as_posix() or any(part in ("", ".", "..") for part in p.parts)
            or "\\" in rel or not rel.isprintable() or len(rel) > 512):
        raise InvalidArgument(f"{rel!r} is not a relative path inside a model directory", param="source",
                              reason="invalid_model_directory")
    return rel


# --- validation ---------------------------------------------------------------
def _json_object(path: Path, rel: str, label: str) -> dict:
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise _bad(label, f"{rel} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(label, f"{rel} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _bad(label, f"{rel} is not a JSON object")
    return doc


def check_safetensors(path: Path, rel: str, label: str) -> None:
    """The header parses and every tensor's data lies inside the file (a truncated copy fails)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise _bad(label, f"{rel} is not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _bad(label, f"{rel} is not a safetensors file (a header of {n} bytes in {size})")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise _bad(label, f"{rel} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise _bad(label, f"{rel} is not a safetensors file (its header is not an object)")
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data):
            raise _bad(label, f"{rel}: tensor {name[:100]!r} lies outside the file (truncated?)")


def check_directory(root: Path, files: list[tuple[str, Path, int]]) -> dict:
    """What vLLM needs to load it; returns config.json's content."""
    label = str(root)
    by_rel = {rel: path for rel, path, _ in files}
    if "config.json" not in by_rel:
        raise _bad(label, "no config.json: not a Hugging Face model directory")
    config = _json_object(by_rel["config.json"], "config.json", label)
    if not config.get("architectures") and not config.get("model_type"):
        raise _bad(label, "config.json names no architectures or model_type")
    weights = [rel for rel in by_rel if rel.endswith(SUFFIX)]
    if not weights:
        raise _bad(label, "no .safetensors file (only safetensors weights are imported)")
    for rel in weights:
        check_safetensors(by_rel[rel], rel, label)
    if "model.safetensors.index.json" in by_rel:
        index = _json_object(by_rel["model.safetensors.index.json"], "model.safetensors.index.json", label)
        shards = set((index.get("weight_map") or {}).values()) if isinstance(index.get("weight_map"), dict) else set()
        missing = sorted(str(s) for s in shards if s not in by_rel)
        if missing:
            raise _bad(label, f"model.safetensors.index.json names shards that are not there: {missing[:5]}")
    return config


def describe_config(config: dict, tokenizer_config: dict) -> tuple[int, str, str]:
    """(context length, tokenizer, quantization) as config.json and tokenizer_config.json say."""
    sub = config.get("text_config")  # multimodal configs keep the language model's here
    text: dict = sub if isinstance(sub, dict) else {}
    context = config.get("max_position_embeddings") or text.get("max_position_embeddings") or 0
    quant = config.get("quantization_config")
    method = quant.get("quant_method", "") if isinstance(quant, dict) else ""
    dtype = config.get("torch_dtype") or config.get("dtype") or ""
    tokenizer = tokenizer_config.get("tokenizer_class") or config.get("model_type") or ""
    return (int(context) if isinstance(context, int) else 0, str(tokenizer)[:100],
            str(method or dtype)[:50])


# --- import -----------------------------------------------------------------
def import_directory(store: ArtifactStore, root: Path, expected_sha256: str = "", progress: Progress | None = None,
                     limits: DirLimits = DirLimits()) -> DirVersion:
    """Checks the directory, copies each file into the store (hashed as copied) and stores
    the manifest. With ``expected_sha256`` (the manifest's) a different digest is refused
    and the blobs this import added are removed."""
    expected_sha256 = expected_sha256.strip().lower()
    if expected_sha256 and not is_sha256(expected_sha256):
        raise InvalidArgument(f"sha256 must be 64 hex digits, got {expected_sha256!r}", param="sha256")
    files = scan(root, limits)
    config = check_directory(root, files)
    tok_path = next((p for rel, p, _ in files if rel == "tokenizer_config.json"), None)
    tok_config = _json_object(tok_path, "tokenizer_config.json", str(root)) if tok_path else {}
    total = sum(size for _, _, size in files)
    done, added, entries = 0, [], []
    try:
        for rel, path, size in files:
            digest, new = _put(store, path, size, rel, lambda n: progress(done + n, total) if progress else None)
            done += size
            if new:
                added.append(digest)
            entries.append(ManifestEntry(rel, digest, size))
        text = manifest_bytes(entries)
        digest = hashlib.sha256(text).hexdigest()
        if expected_sha256 and digest != expected_sha256:
            raise ChecksumMismatch(str(root), expected_sha256, digest)
        if _write_blob(store, digest, text):
            added.append(digest)
    except BaseException:
        for d in added:
            store.blob_path(d).unlink(missing_ok=True)
        raise
    context, tokenizer, quant = describe_config(config, tok_config)
    return DirVersion(digest, total, tuple(entries), context, tokenizer, quant)


def _put(store: ArtifactStore, path: Path, size: int, rel: str, progress) -> tuple[str, bool]:
    """Copies one file into the store: (its sha256, whether the store lacked it)."""
    tmp = store.root / "partial" / f"dir-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    h, copied = hashlib.sha256(), 0
    try:
        try:
            src = path.open("rb")
        except OSError as exc:
            raise _bad(str(path), f"{rel} cannot be read ({exc.strerror})") from None
        with src, tmp.open("wb") as dst:
            while block := src.read(CHUNK):
                h.update(block)
                dst.write(block)
                copied += len(block)
                progress(copied)
        if copied != size:
            raise InvalidArgument(f"{rel} changed while it was imported ({size} bytes, then {copied})",
                                  param="source")
        return h.hexdigest(), _settle(store, tmp, h.hexdigest())
    finally:
        tmp.unlink(missing_ok=True)


def _settle(store: ArtifactStore, tmp: Path, digest: str) -> bool:
    blob = store.blob_path(digest)
    if blob.is_file():
        return False  # same content already stored
    blob.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, blob)
    blob.chmod(0o444)
    return True


def _write_blob(store: ArtifactStore, digest: str, data: bytes) -> bool:
    tmp = store.root / "partial" / f"manifest-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(data)
    try:
        return _settle(store, tmp, digest)
    finally:
        tmp.unlink(missing_ok=True)


# --- the manifest ---------------------------------------------------------------
def manifest_bytes(entries: list[ManifestEntry]) -> bytes:
    """Canonical: the same files give the same bytes, so the same digest."""
    doc = {"format": FORMAT, "files": [{"path": e.path, "sha256": e.sha256, "size": e.size}
                                       for e in sorted(entries, key=lambda e: e.path)]}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def parse_manifest(data: bytes) -> list[ManifestEntry]:
    """The files a manifest lists, every path and digest checked (a fetcher walks these)."""
    try:
        doc = json.loads(data)
        files = doc["files"] if isinstance(doc, dict) and doc.get("format") == FORMAT else None
        if not isinstance(files, list):
            raise ValueError("no files list")
        entries = [ManifestEntry(check_relative(f["path"]), str(f["sha256"]), int(f["size"])) for f in files]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"not a safetensors manifest ({exc})", param="sha256") from None
    for e in entries:
        if not is_sha256(e.sha256) or e.size < 0:
            raise InvalidArgument(f"manifest entry {e.path}: bad digest or size", param="sha256")
    if len({e.path for e in entries}) != len(entries):
        raise InvalidArgument("manifest lists a path twice", param="sha256")
    return entries


def read_manifest(store: ArtifactStore, sha256: str) -> list[ManifestEntry]:
    path = store.blob_path(sha256)
    if not path.is_file():
        raise NotFound(f"manifest {sha256} is not in the store at {store.root}")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise InvalidArgument(f"manifest {sha256} is larger than {MAX_MANIFEST_BYTES} bytes", param="sha256")
    return parse_manifest(path.read_bytes())


def version_files(store: ArtifactStore, artifact: Artifact) -> list[ManifestEntry]:
    """The files an engine needs for ``artifact``, as it finds them in ``<model_dir>/<name@N>/``:
    a GGUF's one file, or every file of a safetensors manifest."""
    if artifact.format == FORMAT:
        return read_manifest(store, artifact.sha256)
    return [ManifestEntry(f"{artifact.variant}.{artifact.format}", artifact.sha256, artifact.size_bytes)]


# --- publishing -------------------------------------------------------------------
def publish_directory(store: ArtifactStore, served: str, sha256: str, manifest: dict) -> Path:
    """Makes a safetensors version loadable as ``served`` by engines sharing ``model_dir``:
    each file linked to its blob at its path. Never writes through a link into a blob."""
    entries = read_manifest(store, sha256)
    folder = store.model_dir / served
    folder.mkdir(parents=True, exist_ok=True)
    for e in entries:
        blob = store.blob_path(e.sha256)
        if not blob.is_file():
            raise NotFound(f"{e.path} ({e.sha256}) of {served} is not in the store at {store.root}")
        target = folder / e.path
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() or target.is_symlink():
            if target.exists() and os.path.samefile(target, blob):
                continue
            target.unlink()
        try:
            os.link(blob, target)
        except OSError:
            target.symlink_to(blob)
        if e.path.endswith(SUFFIX):  # the digest is known: spare ModelStore re-reading the weights
            st = target.stat()
            _replace_text(target.with_name(target.name + SIDECAR), f"{e.sha256} {st.st_size}:{st.st_mtime_ns}\n")
    # model.json lists the files too, as (path, sha256, size): what an engine fetching the folder walks
    files = [{"path": e.path, "sha256": e.sha256, "size": e.size} for e in entries]
    _replace_text(folder / MODEL_JSON, json.dumps({**manifest, "format": FORMAT, "files": files}, indent=2) + "\n")
    return folder


def _replace_text(path: Path, text: str) -> None:
    path.unlink(missing_ok=True)  # a fresh file, never a write into whatever was there
    path.write_text(text)


def publish_artifact(store: ArtifactStore, served: str, artifact: Artifact, manifest: dict) -> Path:
    """Publishes either format for engines: a GGUF file or a safetensors directory."""
    if artifact.format == FORMAT:
        return publish_directory(store, served, artifact.sha256, manifest)
    return store.publish(served, artifact.sha256, f"{artifact.variant}.{artifact.format}", manifest)

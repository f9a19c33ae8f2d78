"""The engine's model fetcher against the model manager's own artifact server, in process
(the wire is tests/component/test_model_fetch.py's): files land verified, a second load
or a shared folder moves nothing, a cut or stalled stream resumes where it stopped (in
the same fetch, or in the next one from the partial file), a digest that differs is an
error that leaves nothing, and sizes, paths and requests out of bounds are refused."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

import pytest

from llmesh.engine.fetcher import FetchFailed, FetchLimits, ModelFetcher, RemoteFile, RemoteManifest
from llmesh.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from llmesh.modelmgr.artifacts import ArtifactStore
from llmesh.modelmgr.distribution import ArtifactServer
from llmesh.modelstore import ModelStore

MiB = 1 << 20
SIZE = 3 * MiB + 12345  # four chunks, the last one short


class ServerSource:
    """The fetcher's ArtifactSource as the model manager's ArtifactServer, called in process
    (no gRPC), recording each stream's start and optionally cutting (``cut_after`` bytes, an
    UNAVAILABLE as a dropped connection reads) or stalling a stream, ``times`` times."""

    def __init__(self, server: ArtifactServer, cut_after: int | None = None, stall_after: int | None = None,
                 times: int = 1):
        self.server = server
        self.cut_after, self.stall_after, self.times = cut_after, stall_after, times
        self.starts: list[int] = []
        self.sent = 0

    async def manifest(self, name: str) -> RemoteManifest:
        m = await asyncio.to_thread(self.server.manifest, name)
        return RemoteManifest(m.served_name, tuple(RemoteFile(f.path, f.sha256, f.size_bytes) for f in m.files),
                              m.metadata_json)

    async def chunks(self, sha256: str, offset: int):
        self.starts.append(offset)
        this = 0
        async for off, data, size in self.server.chunks(sha256, offset):
            if self.times and self.cut_after is not None and this >= self.cut_after:
                self.times -= 1
                raise Unavailable("connection reset")
            if self.times and self.stall_after is not None and this >= self.stall_after:
                self.times -= 1
                await asyncio.sleep(3600)
            yield off, data, size
            self.sent += len(data)
            this += len(data)


@pytest.fixture
def published(tmp_path):
    """A model manager's store holding one GGUF-named blob, published as smol@1 by Deploy's rule."""
    store = ArtifactStore(tmp_path / "store", tmp_path / "mgr-models")
    src = tmp_path / "upload.gguf"
    src.write_bytes(os.urandom(SIZE))
    blob = store.add_file(src, "Q4_1.gguf")
    store.publish("smol@1", blob.sha256, "Q4_1.gguf", {
        "version": "smol:1", "context_length": 512,
        "files": [{"path": "Q4_1.gguf", "sha256": blob.sha256, "size": SIZE}]})
    return store, blob


def fetcher_for(tmp_path: Path, source, **limits) -> ModelFetcher:
    return ModelFetcher(tmp_path / "engine-models", source, FetchLimits(**limits), sleep=lambda s: asyncio.sleep(0))


def server(store: ArtifactStore, **kw) -> ArtifactServer:
    return ArtifactServer(store.model_dir, store.blob_path, chunk_bytes=MiB, **kw)


async def test_fetch_places_verified_files_and_a_second_load_moves_nothing(tmp_path, published):
    store, blob = published
    source = ServerSource(server(store))
    fetcher = fetcher_for(tmp_path, source)
    result = await fetcher.ensure("smol@1")
    assert (result.files, result.downloaded_bytes, result.resumed_bytes, result.reused_files) == (1, SIZE, 0, 0)
    target = tmp_path / "engine-models" / "smol@1" / "Q4_1.gguf"
    assert hashlib.sha256(target.read_bytes()).hexdigest() == blob.sha256
    assert os.stat(target).st_ino != os.stat(store.blob_path(blob.sha256)).st_ino  # a copy of its own
    assert json.loads((target.parent / "model.json").read_text())["context_length"] == 512
    record = ModelStore(tmp_path / "engine-models").get("smol@1")
    assert (record.sha256, record.size_bytes, record.context_length) == (blob.sha256, SIZE, 512)
    assert list(fetcher.partial_dir.iterdir()) == []

    again = await fetcher.ensure("smol@1")
    assert (again.downloaded_bytes, again.reused_files) == (0, 1) and source.sent == SIZE


async def test_a_shared_folder_is_used_as_it_is(tmp_path, published):
    store, blob = published
    folder = store.model_dir / "smol@1"
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    source = ServerSource(server(store))
    result = await ModelFetcher(store.model_dir, source).ensure("smol@1")
    assert (result.downloaded_bytes, result.reused_files, source.starts) == (0, 1, [])
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before  # nothing written


async def test_a_cut_stream_resumes_where_it_stopped(tmp_path, published):
    store, blob = published
    source = ServerSource(server(store), cut_after=2 * MiB)
    result = await fetcher_for(tmp_path, source).ensure("smol@1")
    assert source.starts == [0, 2 * MiB] and source.sent == SIZE  # no byte sent twice
    assert result.downloaded_bytes == SIZE
    assert hashlib.sha256((tmp_path / "engine-models/smol@1/Q4_1.gguf").read_bytes()).hexdigest() == blob.sha256


async def test_a_stalled_stream_is_cut_and_resumed(tmp_path, published):
    store, _ = published
    source = ServerSource(server(store), stall_after=MiB)
    result = await fetcher_for(tmp_path, source, idle_timeout_s=0.2).ensure("smol@1")
    assert source.starts == [0, MiB] and result.downloaded_bytes == SIZE


async def test_a_fetch_that_gives_up_keeps_its_part_and_the_next_load_resumes(tmp_path, published):
    store, blob = published
    source = ServerSource(server(store), cut_after=2 * MiB, times=1)
    with pytest.raises(Unavailable, match="next load resumes"):
        await fetcher_for(tmp_path, source, attempts=1).ensure("smol@1")
    part = tmp_path / "engine-models" / ".partial" / f"{blob.sha256}.part"
    assert part.stat().st_size == 2 * MiB
    assert not (tmp_path / "engine-models" / "smol@1").exists()

    result = await fetcher_for(tmp_path, source, attempts=1).ensure("smol@1")
    assert (result.downloaded_bytes, result.resumed_bytes) == (SIZE - 2 * MiB, 2 * MiB)
    assert source.starts == [0, 2 * MiB] and source.sent == SIZE
    assert not part.exists()
    assert hashlib.sha256((tmp_path / "engine-models/smol@1/Q4_1.gguf").read_bytes()).hexdigest() == blob.sha256


async def test_a_digest_mismatch_is_an_error_and_leaves_nothing(tmp_path, published):
    store, blob = published
    path = store.blob_path(blob.sha256)
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[SIZE // 2] ^= 0xFF  # the stored blob rotted: same size, other content
    path.write_bytes(bytes(data))
    fetcher = fetcher_for(tmp_path, ServerSource(server(store)))
    with pytest.raises(FetchFailed, match="sha256") as err:
        await fetcher.ensure("smol@1")
    assert err.value.reason == "checksum_mismatch"
    assert list(fetcher.partial_dir.iterdir()) == []
    assert not (tmp_path / "engine-models" / "smol@1").exists()


async def test_a_model_over_the_size_bound_is_refused_before_a_byte_moves(tmp_path, published):
    store, _ = published
    source = ServerSource(server(store))
    with pytest.raises(ResourceExhausted, match="fetch_max_bytes"):
        await fetcher_for(tmp_path, source, max_bytes=SIZE - 1).ensure("smol@1")
    assert source.starts == [] and not (tmp_path / "engine-models" / "smol@1").exists()


@pytest.mark.parametrize("path", ["../escape.gguf", "/etc/passwd", "a/../../b.gguf", ".hidden.gguf",
                                  "model.json", "Q4_1.gguf.sha256", "a\\b.gguf", ""])
async def test_a_manifest_path_outside_the_folder_is_refused(tmp_path, published, path):
    store, blob = published
    (store.model_dir / "smol@1" / "model.json").write_text(json.dumps(
        {"files": [{"path": path, "sha256": blob.sha256, "size": SIZE}]}))
    source = ServerSource(server(store))
    with pytest.raises(FetchFailed, match="path"):
        await fetcher_for(tmp_path, source).ensure("smol@1")
    assert source.starts == []


async def test_multi_file_manifests_fetch_every_file(tmp_path):
    """A directory version (safetensors shards and configs): each file a blob, placed by its path."""
    store = ArtifactStore(tmp_path / "store", tmp_path / "mgr-models")
    files = {"config.json": b'{"model_type": "llama"}', "model-00001.safetensors": os.urandom(MiB + 7),
             "tokenizer/tokenizer.json": b"{}"}
    listed = []
    for rel, data in files.items():
        src = tmp_path / "upload"
        src.write_bytes(data)
        blob = store.add_file(src, "x.gguf")  # add_file wants an artifact name; the blob is the bytes
        listed.append({"path": rel, "sha256": blob.sha256, "size": len(data)})
    folder = store.model_dir / "hf@1"
    folder.mkdir(parents=True)
    (folder / "model.json").write_text(json.dumps({"files": listed}))
    result = await fetcher_for(tmp_path, ServerSource(server(store))).ensure("hf@1")
    assert result.files == 3
    for rel, data in files.items():
        assert (tmp_path / "engine-models" / "hf@1" / rel).read_bytes() == data


async def test_unknown_to_the_model_manager_or_it_away(tmp_path, published):
    store, _ = published
    fetcher = fetcher_for(tmp_path, ServerSource(server(store)))
    assert await fetcher.ensure("smollm2-135m-instruct") is None  # not deployed: the build decides

    class Away(ServerSource):
        async def manifest(self, name: str) -> RemoteManifest:
            raise Unavailable("connection refused")

    away = fetcher_for(tmp_path, Away(server(store)))
    with pytest.raises(Unavailable, match="not in this engine's model store"):
        await away.ensure("smol@1")
    local = tmp_path / "engine-models" / "smol@1"
    local.mkdir(parents=True)
    (local / "Q4_1.gguf").write_bytes(b"local copy")
    assert await away.ensure("smol@1") is None  # loads what it has
    with pytest.raises(InvalidArgument):
        await fetcher.ensure("../smol@1")


async def test_the_artifact_server_refuses_what_it_cannot_serve(published):
    store, blob = published
    srv = server(store, max_streams=1)
    with pytest.raises(NotFound, match="not deployed"):
        await asyncio.to_thread(srv.manifest, "smol@9")
    with pytest.raises(InvalidArgument):
        await asyncio.to_thread(srv.manifest, "../etc")
    for sha, offset, error in ((blob.sha256, SIZE + 1, InvalidArgument), ("0" * 64, 0, NotFound),
                               ("not-hex", 0, InvalidArgument)):
        with pytest.raises(error):
            async for _ in srv.chunks(sha, offset):
                pass
    assert [c[0] async for c in srv.chunks(blob.sha256, SIZE)] == [SIZE]  # all held: one empty chunk
    first = srv.chunks(blob.sha256, 0)
    await anext(first)  # one stream open: the bound is reached
    with pytest.raises(ResourceExhausted):
        await anext(srv.chunks(blob.sha256, 0))
    await first.aclose()
    assert len([c async for c in srv.chunks(blob.sha256, 0)]) == 4  # closed streams free their place

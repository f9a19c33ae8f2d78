"""The artifact store against real files and a real HTTP server on 127.0.0.1 that
honours Range requests (and can cut a transfer short, as a flaky network does)."""

from __future__ import annotations

import hashlib
import http.server
import re
import threading

import pytest

from llmesh.errors import InvalidArgument, NotFound, Unavailable
from llmesh.modelmgr.artifacts import ArtifactStore, ChecksumMismatch
from llmesh.modelstore import ModelStore

PAYLOAD = bytes(range(256)) * 4096 + b"tail"  # ~1 MiB, not a round number of chunks
DIGEST = hashlib.sha256(PAYLOAD).hexdigest()


class RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves PAYLOAD at /model.gguf; with server.cut_after set, the first response
    stops after that many bytes and closes the connection."""

    def do_GET(self):  # http.server's naming
        if self.path != "/model.gguf":
            self.send_error(404)
            return
        self.server.ranges.append(self.headers.get("Range"))
        start = 0
        m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if m:
            start = int(m.group(1))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(PAYLOAD) - 1}/{len(PAYLOAD)}")
        else:
            self.send_response(200)
        body = PAYLOAD[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = self.server.cut_after
        if cut is not None:
            self.server.cut_after = None
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RangeHandler)
    server.ranges, server.cut_after = [], None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def store(tmp_path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store", tmp_path / "models", http_timeout_s=5)


def test_local_import_is_content_addressed(store, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(PAYLOAD)
    seen = []
    blob = store.import_source(str(src), DIGEST, progress=lambda done, total: seen.append((done, total)))
    assert blob.sha256 == DIGEST and blob.size_bytes == len(PAYLOAD) and blob.format == "gguf"
    assert blob.path == store.blob_path(DIGEST) and blob.path.read_bytes() == PAYLOAD
    assert seen[-1] == (len(PAYLOAD), len(PAYLOAD))
    again = store.import_source(f"file://{src}")  # same content: the same blob, nothing new
    assert again.path == blob.path
    assert [p.name for p in (store.root / "blobs" / "sha256").iterdir()] == [DIGEST]


def test_checksum_mismatch_is_rejected_and_nothing_kept(store, tmp_path, http_server):
    src = tmp_path / "m.gguf"
    src.write_bytes(PAYLOAD)
    wrong = "0" * 64
    with pytest.raises(ChecksumMismatch) as err:
        store.import_source(str(src), wrong)
    assert err.value.reason == "checksum_mismatch" and DIGEST in err.value.message
    url = f"http://127.0.0.1:{http_server.server_port}/model.gguf"
    with pytest.raises(ChecksumMismatch):
        store.import_source(url, wrong)
    assert not store.has(DIGEST) and not store.has(wrong)
    assert not any((store.root / "partial").iterdir())
    with pytest.raises(InvalidArgument):
        store.import_source(str(src), "not-hex")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(InvalidArgument):
        store.import_source(str(tmp_path / "notes.txt"))
    with pytest.raises(NotFound):
        store.import_source(str(tmp_path / "missing.gguf"))
    with pytest.raises(NotFound):
        store.import_source("package:surely-not-installed-pkg")


def test_http_import_resumes_an_interrupted_download(store, http_server):
    url = f"http://127.0.0.1:{http_server.server_port}/model.gguf"
    http_server.cut_after = 300_000
    with pytest.raises(Unavailable, match="resume"):
        store.import_source(url, DIGEST)
    blob = store.import_source(url, DIGEST)
    assert blob.path.read_bytes() == PAYLOAD
    assert http_server.ranges == [None, "bytes=300000-"]  # the second request asked only for the rest
    with pytest.raises(NotFound):
        store.import_source(url.replace("model", "other"))


def test_publish_makes_a_version_loadable_by_engines(store, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(PAYLOAD)
    blob = store.import_source(str(src))
    path = store.publish("m@1", blob.sha256, "Q4_1.gguf", {"source": "test", "version": "m:1", "context_length": 8192})
    assert path.read_bytes() == PAYLOAD
    record = ModelStore(store.model_dir).get("m@1")
    assert record.sha256 == DIGEST and record.source == "test"  # the sidecar spares a re-hash
    store.unpublish("m@1")
    assert ModelStore(store.model_dir).get("m@1") is None

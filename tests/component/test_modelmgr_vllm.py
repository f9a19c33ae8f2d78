"""The model manager deploys a Hugging Face safetensors directory to real vLLM engines, as it
deploys a GGUF file to llama.cpp ones: the real scheduler, two engines with the vllm backend
on vLLM's real AsyncLLM (vLLM's CPU build, .venv-vllm) started with no model, and the model
manager over gRPC with a live config file for its aliases. SmolLM2's fp32 directory
(`make vllm-model`) is imported twice (the same weights as versions 1 and 2, different
lineage); each deploy publishes the files, the engine loads the directory by the version's
served name, warms it and answers; an alias is promoted to version 1, then through a canary
and the eval gate to version 2, and rolled back. A GGUF version is refused on these engines.
Two AsyncLLMs run at once (~3.5 GiB each): run it under the vLLM lock,

    flock /work/wt/vllm.lock .venv-vllm/bin/python -m pytest -q tests/component/test_modelmgr_vllm.py"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path

import grpc
import pytest
import yaml

from llmesh.engine.app import EngineApp
from llmesh.engine.config import EngineSettings
from llmesh.engine.lifecycle import NoModel
from llmesh.modelmgr.app import ModelMgrApp
from llmesh.modelmgr.config import ModelMgrSettings
from llmesh.modelmgr.hfdir import read_manifest
from llmesh.platform import build_platform
from llmesh.rpc.channels import mesh_channel
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings
from llmesh.settings import MeshSettings
from llmesh.testing import free_ports
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, modelmgr_pb2, modelmgr_pb2_grpc
from tests.component.vllm_faults import require_vllm

SMOL = "smollm2-135m-instruct"


@pytest.fixture
def hf_model() -> Path:
    require_vllm()
    path = Path(os.environ.get("LLMESH_VLLM_TEST_MODEL",
                               Path.home() / ".cache/llmesh/models/smollm2-135m-instruct-hf-fp32"))
    if not (path / "config.json").exists():
        pytest.fail(f"no model at {path}: run 'make vllm-model'")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine
    return path


def vllm_engine(endpoint_id: str, models: Path, scheduler: str) -> EngineApp:
    """A vllm engine with no model yet, as the model manager finds a fresh GPU node: fp32 and eager
    mode through its settings (as test_vllm_real's engine), its models from the shared store."""
    settings = EngineSettings(port=free_ports(1)[0], host="127.0.0.1", endpoint_id=endpoint_id, backend="vllm",
                              model_dir=models, vllm_max_model_len=2048, vllm_enable_lora=False,
                              vllm_dtype="float32", vllm_engine_args={"enforce_eager": True}, vllm_kv_events=False,
                              max_running=4, scheduler_address=scheduler, self_test_interval_s=600,
                              report_interval_s=0.2)
    return EngineApp(settings, backend=NoModel("vllm"))


async def ask(address: str, model: str, prompt: str) -> str:
    req = engine_pb2.GenerateRequest(
        model=model, chat=engine_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content=prompt)]),
        sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0, seed=0))
    async with mesh_channel(address, "engine") as ch:
        return "".join([r.text async for r in engine_pb2_grpc.EngineStub(ch).Generate(req, timeout=120)])


def split(config: Path, alias: str) -> dict[str, float]:
    doc = yaml.safe_load(config.read_text())
    return {t["model"]: t["weight"] for t in doc["splits"][alias]["targets"]}


async def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call
    return exc.value.code(), exc.value.details()


async def imported(stub, name: str, source: str, **fields) -> modelmgr_pb2.ModelVersion:
    updates = [u async for u in stub.ImportModel(modelmgr_pb2.ImportModelRequest(name=name, source=source, **fields),
                                                 timeout=600)]
    return updates[-1].version


async def test_deploy_promote_and_roll_back_safetensors_versions_on_real_vllm(tmp_path, hf_model, real_model_dir):
    models, config = tmp_path / "models", tmp_path / "llmesh.yaml"
    config.write_text("default: {max_attempts: 2}\n")
    golden = tmp_path / "golden.jsonl"
    golden.write_text("\n".join(json.dumps({"prompt": p}) for p in ("What is 2 + 2?", "Name a color.")) + "\n")
    scheduler = SchedulerApp(SchedulerSettings(port=0, host="127.0.0.1"))
    await scheduler.start()
    engines = [vllm_engine(e, models, scheduler.advertise_address) for e in ("vllm-a", "vllm-b")]
    platform = build_platform("modelmgr", MeshSettings(discovery="static", config_backend="file",
                                                       config_file=config, trust="local"))
    mgr = ModelMgrApp(ModelMgrSettings(
        port=free_ports(1)[0], host="127.0.0.1", model_dir=models, store_dir=tmp_path / "store",
        database_url=f"sqlite:///{tmp_path / 'r.db'}", scheduler_address=scheduler.advertise_address,
        vllm_gpus_per_replica=0, warmup_generations=2, settle_s=0.2, drain_timeout_s=10, golden_set=golden,
        eval_max_tokens=8), platform=platform)
    try:
        for e in engines:
            await e.start()
        await mgr.start()
        deadline = time.monotonic() + 10
        while len(scheduler.table.snapshot()) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        async with mesh_channel(mgr.server.bound_address, "modelmgr") as ch:
            stub = modelmgr_pb2_grpc.ModelManagerStub(ch)
            v1 = await imported(stub, "hf", str(hf_model), lineage={"note": "first"})
            [a] = v1.artifacts
            assert (a.format, a.quantization, v1.context_length) == ("safetensors", "float32", 8192)
            v2 = await imported(stub, "hf", str(hf_model), sha256=a.sha256, parent_version=1,
                                lineage={"note": "same weights, registered again"})
            assert v2.version == 2 and v2.artifacts[0].sha256 == a.sha256

            gguf = next((real_model_dir / SMOL).glob("*.gguf"))
            await imported(stub, "smol", str(gguf))
            code, why = await refused(stub.Deploy(modelmgr_pb2.DeployRequest(name="smol", version=1)))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "only llamacpp engines load" in why

            deployed = await stub.Deploy(modelmgr_pb2.DeployRequest(name="hf", version=1), timeout=600)
            [rep] = deployed.replicas
            assert rep.state == "ready" and deployed.state == "staged", deployed
            first = next(e for e in engines if e.settings.endpoint_id == rep.endpoint_id)
            assert first.backend.name == "vllm" and first.backend.model == "hf@1"
            for f in read_manifest(mgr.artifacts, a.sha256):  # the engine loaded the files the manifest lists
                published = models / "hf@1" / f.path
                assert os.path.samefile(published, mgr.artifacts.blob_path(f.sha256))
            big = max(read_manifest(mgr.artifacts, a.sha256), key=lambda f: f.size)
            assert big.path.endswith(".safetensors")
            assert hashlib.sha256((models / "hf@1" / big.path).read_bytes()).hexdigest() == big.sha256
            assert "Paris" in await ask(rep.address, "hf@1", "What is the capital of France?")

            alias = (await stub.Promote(modelmgr_pb2.PromoteRequest(alias="assistant", name="hf", version=1))).alias
            assert alias.current == "hf:1" and split(config, "assistant") == {"hf@1": 1}

            # version 2 goes to the other engine: the one serving hf@1 serves the alias
            deployed = await stub.Deploy(modelmgr_pb2.DeployRequest(name="hf", version=2), timeout=600)
            [rep2] = deployed.replicas
            assert rep2.state == "ready" and rep2.endpoint_id != rep.endpoint_id
            assert "Paris" in await ask(rep2.address, "hf@2", "What is the capital of France?")

            promoted = await stub.Promote(modelmgr_pb2.PromoteRequest(
                alias="assistant", name="hf", version=2, canary_percent=[50], canary_step_s=0.2), timeout=600)
            assert promoted.alias.current == "hf:2" and promoted.alias.previous == "hf:1"
            assert promoted.eval.passed and promoted.eval.similarity > 0.9  # the same weights, greedy
            assert split(config, "assistant") == {"hf@2": 1}
            states = {v.version: v.state for v in (await stub.ListVersions(
                modelmgr_pb2.ListVersionsRequest(name="hf"))).versions}
            assert states == {1: "deprecated", 2: "serving"}

            back = await stub.Rollback(modelmgr_pb2.RollbackRequest(alias="assistant"), timeout=120)
            assert back.current == "hf:1" and back.previous == "hf:2"
            assert split(config, "assistant") == {"hf@1": 1}
            kinds = [e.kind for e in (await stub.History(modelmgr_pb2.HistoryRequest(alias="assistant"))).events]
            assert kinds[0] == "promoted" and kinds.index("canary") < kinds.index("rolled_back")
            assert "Paris" in await ask(rep.address, "hf@1", "What is the capital of France?")  # still loaded
    finally:
        await mgr.stop(0)
        for e in engines:
            await e.stop(0.5)
        await scheduler.stop(0.5)
        await platform.close()

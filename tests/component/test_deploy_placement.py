"""The model manager's deploy goes where the scheduler's Place puts it: the real
scheduler, a real llama.cpp engine on SmolLM2 reporting its real hardware to it, and
the model manager over gRPC. A deploy loads and warms the version on the engine the
plan names; a request the fleet cannot hold is refused whole, with the scheduler's
reason (too few engines: FAILED_PRECONDITION; too little memory for every variant:
RESOURCE_EXHAUSTED)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import grpc
import pytest

from llmesh.engine.app import EngineApp
from llmesh.engine.config import EngineSettings
from llmesh.modelmgr.app import ModelMgrApp
from llmesh.modelmgr.config import ModelMgrSettings
from llmesh.rpc.channels import mesh_channel
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings
from llmesh.testing import free_ports
from llmesh.v1 import modelmgr_pb2, modelmgr_pb2_grpc

SMOL = "smollm2-135m-instruct"


async def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call
    return exc.value.code(), exc.value.details()


async def test_deploy_follows_the_schedulers_plan(tmp_path, real_model_dir: Path):
    models = tmp_path / "models"
    models.mkdir()
    (models / SMOL).symlink_to(real_model_dir / SMOL, target_is_directory=True)
    scheduler = SchedulerApp(SchedulerSettings(port=0, host="127.0.0.1"))
    await scheduler.start()
    mgr_port, engine_port, tight_port = free_ports(3)
    # The engine shares the model manager's folder (as `llmesh up` does): it asks for the
    # manifest, finds every file in place with its digest, and nothing is streamed.
    engine = EngineApp(EngineSettings(port=engine_port, host="127.0.0.1", endpoint_id="llama-1",
                                      backend="llamacpp", model=SMOL, model_dir=models, n_ctx=512, n_threads=1,
                                      scheduler_address=scheduler.advertise_address, self_test_interval_s=600,
                                      report_interval_s=0.2, modelmgr_address=f"127.0.0.1:{mgr_port}"))
    common = dict(model_dir=models, store_dir=tmp_path / "store", database_url=f"sqlite:///{tmp_path / 'r.db'}",
                  scheduler_address=scheduler.advertise_address, warmup_generations=1, host="127.0.0.1")
    mgr = ModelMgrApp(ModelMgrSettings(port=mgr_port, **common))
    # the same registry with a budget no engine's memory meets
    tight = ModelMgrApp(ModelMgrSettings(port=tight_port, memory_budget=1e-6, **common))
    try:
        await engine.start()
        await mgr.start()
        await tight.start()
        deadline = time.monotonic() + 10
        while not scheduler.table.snapshot():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        gguf = next((real_model_dir / SMOL).glob("*.gguf"))
        async with mesh_channel(mgr.server.bound_address, "modelmgr") as ch, \
                mesh_channel(tight.server.bound_address, "engine") as tight_ch:
            stub = modelmgr_pb2_grpc.ModelManagerStub(ch)
            async for _ in stub.ImportModel(modelmgr_pb2.ImportModelRequest(
                    name="smol", source=str(gguf), sha256=hashlib.sha256(gguf.read_bytes()).hexdigest())):
                pass
            code, why = await refused(stub.Deploy(modelmgr_pb2.DeployRequest(name="smol", version=1, replicas=2)))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "1 found" in why
            code, why = await refused(modelmgr_pb2_grpc.ModelManagerStub(tight_ch).Deploy(
                modelmgr_pb2.DeployRequest(name="smol", version=1)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "no variant fits" in why and "llama-1:" in why
            v = await stub.Deploy(modelmgr_pb2.DeployRequest(name="smol", version=1), timeout=120)
            assert [(r.endpoint_id, r.state) for r in v.replicas] == [("llama-1", "ready")]
            assert engine.backend.model == "smol@1"
            assert (models / "smol@1" / "Q4_1.gguf").samefile(mgr.artifacts.blob_path(v.artifacts[0].sha256))
            assert not mgr.metrics.get_sample_value("llmesh_modelmgr_artifact_sent_bytes_total")  # nothing moved
            # deployed again: the engine already serving it keeps its replica, nothing reloads
            again = await stub.Deploy(modelmgr_pb2.DeployRequest(name="smol", version=1), timeout=60)
            assert [(r.endpoint_id, r.state) for r in again.replicas] == [("llama-1", "ready")]
    finally:
        await tight.stop(0)
        await mgr.stop(0)
        await engine.stop(0.5)
        await scheduler.stop(0.5)

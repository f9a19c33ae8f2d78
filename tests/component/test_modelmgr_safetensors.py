"""A Hugging Face safetensors directory through the model manager over real gRPC, with the
real scheduler and a real (sim) engine: `llmesh models import NAME DIR` registers it as a
version named by its manifest's digest; a directory vLLM could not load is refused with
INVALID_ARGUMENT and the reason; deploying it where no vllm engine runs is
FAILED_PRECONDITION naming the backend it needs. (Deploying it to a real vLLM engine:
test_modelmgr_vllm.py, with .venv-vllm.)"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import time

import grpc
import pytest

from llmesh.engine.app import EngineApp
from llmesh.engine.config import EngineSettings
from llmesh.engine.lifecycle import NoModel
from llmesh.modelmgr.app import ModelMgrApp
from llmesh.modelmgr.config import ModelMgrSettings
from llmesh.modelmgr.hfdir import read_manifest
from llmesh.rpc.channels import mesh_channel
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings
from llmesh.testing import free_ports
from llmesh.v1 import modelmgr_pb2, modelmgr_pb2_grpc
from tests.hf_model import make_model


async def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call
    return exc.value.code(), exc.value.details()


async def import_refused(stub, source: str) -> tuple[grpc.StatusCode, str]:
    async def run():
        async for _ in stub.ImportModel(modelmgr_pb2.ImportModelRequest(name="tiny", source=source)):
            pass
    return await refused(run())


async def test_import_a_safetensors_directory_and_place_it_only_on_vllm(tmp_path):
    scheduler = SchedulerApp(SchedulerSettings(port=0, host="127.0.0.1"))
    await scheduler.start()
    engine = EngineApp(EngineSettings(port=free_ports(1)[0], host="127.0.0.1", endpoint_id="sim-1", backend="sim",
                                      model="sim-model", scheduler_address=scheduler.advertise_address,
                                      self_test_interval_s=600, report_interval_s=0.2))
    # an engine with no model yet (a fresh node, or after an unload): nothing to self-test, still placeable
    empty = EngineApp(EngineSettings(port=free_ports(1)[0], host="127.0.0.1", endpoint_id="empty-1", backend="sim",
                                     scheduler_address=scheduler.advertise_address, self_test_interval_s=600,
                                     report_interval_s=0.2), backend=NoModel("sim"))
    mgr = ModelMgrApp(ModelMgrSettings(
        port=free_ports(1)[0], host="127.0.0.1", model_dir=tmp_path / "models", store_dir=tmp_path / "store",
        database_url=f"sqlite:///{tmp_path / 'r.db'}", scheduler_address=scheduler.advertise_address,
        import_max_files=20))
    src = make_model(tmp_path / "tiny-hf", **{"generation_config.json": '{"do_sample": false}'})
    try:
        await engine.start()
        await empty.start()
        await mgr.start()
        deadline = time.monotonic() + 10
        while len(scheduler.table.snapshot()) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        nodes = {e.endpoint_id: e for e in scheduler.table.snapshot()}
        assert nodes["empty-1"].healthy and not nodes["empty-1"].degraded and not nodes["empty-1"].models
        address = mgr.server.bound_address
        proc = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "llmesh", "models", "--address", address, "import", "tiny", str(src),
            "--quiet", "--lineage", "base=tiny"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        async with mesh_channel(address, "modelmgr") as ch:
            stub = modelmgr_pb2_grpc.ModelManagerStub(ch)
            v = await stub.GetVersion(modelmgr_pb2.GetVersionRequest(name="tiny", version=1))
            [a] = v.artifacts
            assert (a.format, a.variant, a.quantization) == ("safetensors", "float32", "float32")
            assert f"sha256 {a.sha256}" in proc.stdout and "safetensors" in proc.stdout
            assert (v.state, v.context_length, v.tokenizer, dict(v.lineage)) == \
                ("validated", 8192, "GPT2Tokenizer", {"base": "tiny"})
            files = read_manifest(mgr.artifacts, a.sha256)
            assert [f.path for f in files] == ["config.json", "generation_config.json", "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json"]
            assert a.size_bytes == sum(f.size for f in files)
            for f in files:
                assert hashlib.sha256((src / f.path).read_bytes()).hexdigest() == f.sha256

            # the same directory again with the digest the first import printed: a second version
            v2 = [p async for p in stub.ImportModel(modelmgr_pb2.ImportModelRequest(
                name="tiny", source=f"file://{src}", sha256=a.sha256))][-1].version
            assert v2.version == 2 and v2.artifacts[0].sha256 == a.sha256

            code, why = await import_refused(stub, str(make_model(tmp_path / "many", **{
                f"shard-{i}.bin": "x" for i in range(30)})))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "more than 20 files" in why
            (tmp_path / "escape").mkdir()
            (tmp_path / "escape" / "config.json").symlink_to(src / "config.json")
            code, why = await import_refused(stub, str(tmp_path / "escape"))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "links outside the directory" in why
            (src / "model.safetensors").rename(tmp_path / "weights.safetensors")
            code, why = await import_refused(stub, str(src))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "no .safetensors file" in why
            assert len((await stub.ListVersions(modelmgr_pb2.ListVersionsRequest())).versions) == 2

            code, why = await refused(stub.Deploy(modelmgr_pb2.DeployRequest(name="tiny", version=1)))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert "tiny:1 is a safetensors version, which only vllm engines load: " in why
            v = await stub.GetVersion(modelmgr_pb2.GetVersionRequest(name="tiny", version=1))
            assert v.state == "validated" and not v.replicas
            assert not (tmp_path / "models" / "tiny@1").exists()  # nothing published for a refused deploy
    finally:
        await mgr.stop(0)
        await empty.stop(0.5)
        await engine.stop(0.5)
        await scheduler.stop(0.5)

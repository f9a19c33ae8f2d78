"""Engines get deployed models from the model manager over gRPC, with no directory shared
between them: the real scheduler, a real llama.cpp engine on SmolLM2 with a model store of
its own, and the model manager with its own store and publish folder. A deploy makes the
engine fetch the version (GetArtifactManifest, FetchArtifact), check its sha256, load and
answer; a fetch cut midway (the model manager stopped under it, then started again on the
same port) resumes from the bytes the engine holds."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from pathlib import Path

import grpc
import pytest

from llmesh.engine.app import EngineApp
from llmesh.engine.config import EngineSettings
from llmesh.modelmgr.app import ModelMgrApp
from llmesh.modelmgr.config import ModelMgrSettings
from llmesh.platform import standalone_platform
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import Credentials, Identity
from llmesh.rpc.pki import ensure_pki
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings
from llmesh.testing import free_ports
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, modelmgr_pb2, modelmgr_pb2_grpc

SMOL = "smollm2-135m-instruct"
SENT = "llmesh_modelmgr_artifact_sent_bytes_total"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def answer(engine: EngineApp, model: str) -> str:
    async with mesh_channel(engine.server.bound_address, "engine") as ch:
        req = engine_pb2.GenerateRequest(
            model=model, chat=engine_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content="Hi!")]),
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, seed=0))
        return "".join([r.text async for r in engine_pb2_grpc.EngineStub(ch).Generate(req, timeout=60)])


async def test_engines_fetch_deployed_models_and_resume_a_cut_fetch(tmp_path, real_model_dir: Path, caplog):
    caplog.set_level(logging.INFO, logger="llmesh.engine.fetcher")
    engine_models, mgr_models = tmp_path / "engine-models", tmp_path / "mgr-models"
    engine_models.mkdir()
    (engine_models / SMOL).symlink_to(real_model_dir / SMOL, target_is_directory=True)  # what it starts on
    scheduler = SchedulerApp(SchedulerSettings(port=0, host="127.0.0.1"))
    await scheduler.start()
    mgr_port, engine_port = free_ports(2)
    mgr_settings = ModelMgrSettings(port=mgr_port, host="127.0.0.1", model_dir=mgr_models,
                                    store_dir=tmp_path / "store", database_url=f"sqlite:///{tmp_path / 'r.db'}",
                                    scheduler_address=scheduler.advertise_address, warmup_generations=1)
    mgr = ModelMgrApp(mgr_settings)
    engine = EngineApp(EngineSettings(port=engine_port, host="127.0.0.1", endpoint_id="llama-1", backend="llamacpp",
                                      model=SMOL, model_dir=engine_models, n_ctx=512, n_threads=1,
                                      scheduler_address=scheduler.advertise_address,
                                      modelmgr_address=f"127.0.0.1:{mgr_port}", self_test_interval_s=600,
                                      report_interval_s=0.2, fetch_attempts=30))
    gguf = next((real_model_dir / SMOL).glob("*.gguf"))
    size, digest = gguf.stat().st_size, sha256(gguf)
    try:
        await engine.start()
        await mgr.start()
        deadline = time.monotonic() + 10
        while not scheduler.table.snapshot():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        async with mesh_channel(mgr.server.bound_address, "modelmgr") as ch:
            stub = modelmgr_pb2_grpc.ModelManagerStub(ch)
            for name in ("smol", "smolb"):  # the same weights as two models: two fetches
                async for _ in stub.ImportModel(modelmgr_pb2.ImportModelRequest(name=name, source=str(gguf),
                                                                                sha256=digest)):
                    pass
            v = await stub.Deploy(modelmgr_pb2.DeployRequest(name="smol", version=1), timeout=300)
        assert [(r.endpoint_id, r.state) for r in v.replicas] == [("llama-1", "ready")]
        fetched = engine_models / "smol@1" / "Q4_1.gguf"
        assert engine.backend.model == "smol@1" and sha256(fetched) == digest
        published = mgr_models / "smol@1" / "Q4_1.gguf"
        assert os.stat(fetched).st_ino != os.stat(published).st_ino  # its own copy, nothing shared
        assert mgr.metrics.get_sample_value(SENT) == size
        assert await answer(engine, "smol@1")
        done = [r for r in caplog.records if r.getMessage() == "model fetched"]
        assert [(r.model, r.bytes, r.resumed_bytes) for r in done] == [("smol@1", size, 0)]

        # smolb: the model manager goes away under the fetch and comes back on its port
        await asyncio.to_thread(mgr.artifacts.publish, "smolb@1", digest, "Q4_1.gguf",
                                {"context_length": 8192, "files": [{"path": "Q4_1.gguf", "sha256": digest,
                                                                    "size": size}]})
        part = engine_models / ".partial" / f"{digest}.part"
        async with mesh_channel(engine.server.bound_address, "engine") as ch:
            load = asyncio.ensure_future(engine_pb2_grpc.EngineStub(ch).LoadModel(
                engine_pb2.LoadModelRequest(name="smolb@1", warmup=True), timeout=300))
            deadline = time.monotonic() + 60
            while not (part.exists() and part.stat().st_size > 0):
                assert time.monotonic() < deadline and not load.done(), load
                await asyncio.sleep(0)
            await mgr.stop(0)  # cut: the stream ends midway
            cut_at = part.stat().st_size
            assert 0 < cut_at < size
            mgr = ModelMgrApp(mgr_settings)
            await mgr.start()
            resp = await load
        assert resp.model.name == "smolb@1" and engine.backend.model == "smolb@1"
        assert sha256(engine_models / "smolb@1" / "Q4_1.gguf") == digest and not part.exists()
        resumed = [r for r in caplog.records if r.getMessage() == "fetch interrupted; resuming"]
        assert resumed and all(r.from_byte >= cut_at for r in resumed)
        assert mgr.metrics.get_sample_value(SENT) == size - resumed[-1].from_byte  # only what was missing
        assert await answer(engine, "smolb@1")
    finally:
        await mgr.stop(0)
        await engine.stop(0.5)
        await scheduler.stop(0.5)


INSTANCES = [("engine", "engine-0"), ("gateway", "gateway-0"), ("modelmgr", "modelmgr-0")]


async def test_only_engines_may_fetch(tmp_path):
    """The mesh policy, with real certificates in token trust: an engine fetches, a gateway
    (or anyone else) is PERMISSION_DENIED on both methods."""
    files = ensure_pki(tmp_path / "pki", INSTANCES)
    ident = {i: Identity(s, "token", Credentials.load(files[i].ca_file, files[i].cert_file, files[i].key_file))
             for s, i in INSTANCES}
    platform = standalone_platform("modelmgr")
    platform.identity = ident["modelmgr-0"]
    store = tmp_path / "store"
    mgr = ModelMgrApp(ModelMgrSettings(port=0, host="127.0.0.1", model_dir=tmp_path / "models", store_dir=store,
                                       database_url=f"sqlite:///{tmp_path / 'r.db'}"), platform)
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + bytes(100))
    blob = mgr.artifacts.add_file(src, "m.gguf")
    mgr.artifacts.publish("m@1", blob.sha256, "m.gguf", {})
    await mgr.server.start()
    try:
        for who, ok in (("engine-0", True), ("gateway-0", False)):
            async with mesh_channel(mgr.server.bound_address, "modelmgr", ident[who]) as ch:
                stub = modelmgr_pb2_grpc.ModelManagerStub(ch)
                calls = (stub.GetArtifactManifest(modelmgr_pb2.GetArtifactManifestRequest(served_name="m@1"),
                                                  timeout=10),
                         _drain(stub.FetchArtifact(modelmgr_pb2.FetchArtifactRequest(sha256=blob.sha256), timeout=10)))
                for call in calls:
                    if ok:
                        got = await call
                        assert got.files[0].sha256 == blob.sha256 if hasattr(got, "files") else got == 104
                    else:
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await call
                        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await mgr.server.stop(0)
        mgr.db.dispose()


async def _drain(stream) -> int:
    return sum([len(r.data) async for r in stream])

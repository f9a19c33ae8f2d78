"""The model manager in process over real gRPC, with its SQLite registry and artifact
store on disk and the real SmolLM2 GGUF: import streams progress and verifies the
checksum (a mismatch is INVALID_ARGUMENT and leaves nothing), llama.cpp's quantizer
adds real Q8_0 and Q4_0 variants recorded with the version, and rollout calls that
cannot succeed say why with the right status code."""

from __future__ import annotations

import hashlib
from pathlib import Path

import grpc
import pytest

from llmesh.modelmgr.app import ModelMgrApp
from llmesh.modelmgr.config import ModelMgrSettings
from llmesh.rpc.channels import mesh_channel
from llmesh.testing import free_ports
from llmesh.v1 import modelmgr_pb2, modelmgr_pb2_grpc

SMOL = "smollm2-135m-instruct"


@pytest.fixture
async def modelmgr(tmp_path):
    scheduler_port, port = free_ports(2)  # nothing listens on the scheduler's: it is away
    app = ModelMgrApp(ModelMgrSettings(port=port, model_dir=tmp_path / "models", store_dir=tmp_path / "store",
                                       database_url=f"sqlite:///{tmp_path / 'registry.db'}",
                                       scheduler_address=f"127.0.0.1:{scheduler_port}"))
    await app.start()
    async with mesh_channel(app.server.bound_address, "modelmgr") as channel:
        yield modelmgr_pb2_grpc.ModelManagerStub(channel), app
    await app.stop(0)


async def test_import_quantize_and_refusals(modelmgr, real_model_dir: Path):
    stub, app = modelmgr
    gguf = next((real_model_dir / SMOL).glob("*.gguf"))
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()

    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.ImportModel(modelmgr_pb2.ImportModelRequest(name="smol", source=str(gguf),
                                                                        sha256="f" * 64)):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and digest in err.value.details()
    assert not (app.artifacts.blob_path(digest)).exists()
    assert not (await stub.ListVersions(modelmgr_pb2.ListVersionsRequest())).versions

    updates = [p async for p in stub.ImportModel(modelmgr_pb2.ImportModelRequest(
        name="smol", source=str(gguf), sha256=digest, lineage={"training_data": "smoltalk"}))]
    v = updates[-1].version
    assert updates[-1].bytes_done == updates[-1].bytes_total == gguf.stat().st_size
    assert (v.name, v.version, v.state, v.served_name) == ("smol", 1, "validated", "smol@1")
    assert v.context_length == 8192 and v.tokenizer == "gpt2" and dict(v.lineage) == {"training_data": "smoltalk"}
    assert [(a.variant, a.sha256) for a in v.artifacts] == [("Q4_1", digest)]

    for q in ("Q8_0", "Q4_0"):
        v = await stub.QuantizeVersion(modelmgr_pb2.QuantizeVersionRequest(name="smol", version=1, quantization=q))
    sizes = {a.variant: a.size_bytes for a in v.artifacts}
    assert list(sizes) == ["Q4_1", "Q8_0", "Q4_0"]
    assert sizes["Q8_0"] > sizes["Q4_1"] > sizes["Q4_0"]  # more bits per weight, more bytes
    assert {a.quantization for a in v.artifacts} == {"Q4_1", "Q8_0", "Q4_0"}
    assert all(a.derived_from == "Q4_1" for a in v.artifacts[1:])
    assert len({a.sha256 for a in v.artifacts}) == 3
    for a in v.artifacts:
        assert hashlib.sha256(app.artifacts.blob_path(a.sha256).read_bytes()).hexdigest() == a.sha256

    async def code_of(call) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        return e.value.code()

    assert await code_of(stub.QuantizeVersion(modelmgr_pb2.QuantizeVersionRequest(
        name="smol", version=1, quantization="Q9_9"))) == grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(stub.GetVersion(modelmgr_pb2.GetVersionRequest(name="smol", version=7))) \
        == grpc.StatusCode.NOT_FOUND
    assert await code_of(stub.Deploy(modelmgr_pb2.DeployRequest(name="smol", version=1))) \
        == grpc.StatusCode.UNAVAILABLE  # the scheduler is away
    assert await code_of(stub.Rollback(modelmgr_pb2.RollbackRequest(alias="nobody"))) \
        == grpc.StatusCode.FAILED_PRECONDITION
    assert await code_of(stub.Promote(modelmgr_pb2.PromoteRequest(alias="a", name="smol", version=1))) \
        == grpc.StatusCode.UNAVAILABLE
    history = (await stub.History(modelmgr_pb2.HistoryRequest(name="smol"))).events
    assert [e.kind for e in history] == ["registered", "validated", "variant_added", "variant_added"]

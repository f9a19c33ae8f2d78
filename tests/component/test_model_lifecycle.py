"""Model lifecycle RPCs on a real engine process-in-a-task over gRPC: load with warmup,
swap while a request is in flight, unload, list; a failing load leaves the engine
serving what it served and says why. Also: the llama.cpp engine loads the real model."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from llmesh.rpc.channels import mesh_channel
from llmesh.testing import free_ports
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from llmesh.engine.app import EngineApp
from llmesh.engine.config import EngineSettings


@pytest.fixture
async def engine():
    apps = []

    async def start(**fields):
        settings = EngineSettings(port=free_ports(1)[0], endpoint_id="lc", scheduler_address=None,
                                  self_test_interval_s=600, **fields)
        app = EngineApp(settings)
        await app.start()
        apps.append(app)
        channel = mesh_channel(app.server.bound_address, "engine")
        return engine_pb2_grpc.EngineStub(channel), channel

    yield start
    for app in apps:
        await app.stop(0)


def ask(model: str, max_tokens: int = 4) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(model=model, chat=engine_pb2.ChatInput(messages=[
        common_pb2.ChatMessage(role="user", content="hello there")]),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


async def text_of(stub, req) -> str:
    return "".join([r.text async for r in stub.Generate(req, timeout=30)])


async def test_load_swap_unload_and_list(engine):
    stub, ch = await engine(backend="sim", model="sim-a", sim_decode_ms_per_token=20, sim_output_tokens=30)
    async with ch:
        listed = await stub.ListLoadedModels(engine_pb2.ListLoadedModelsRequest())
        assert [(m.name, m.backend) for m in listed.models] == [("sim-a", "sim")]
        in_flight = asyncio.ensure_future(text_of(stub, ask("sim-a", 20)))
        await asyncio.sleep(0.1)
        loaded = await stub.LoadModel(engine_pb2.LoadModelRequest(name="sim-b", warmup=True))
        assert loaded.model.name == "sim-b" and loaded.replaced == "sim-a" and loaded.warmup_ms > 0
        assert len((await in_flight).split()) == 20  # the old model finished its request
        assert await text_of(stub, ask("sim-b"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await text_of(stub, ask("sim-a"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
        assert list(status.models) == ["sim-b"]
        await stub.UnloadModel(engine_pb2.UnloadModelRequest(name="sim-b"))
        assert not (await stub.ListLoadedModels(engine_pb2.ListLoadedModelsRequest())).models
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await text_of(stub, ask("sim-b"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.UnloadModel(engine_pb2.UnloadModelRequest(name="sim-b"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        await stub.LoadModel(engine_pb2.LoadModelRequest(name="sim-c"))
        assert await text_of(stub, ask("sim-c"))


async def test_a_failed_load_leaves_the_engine_serving_and_says_why(engine):
    stub, ch = await engine(backend="sim", model="sim-a", sim_decode_ms_per_token=1)
    async with ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.LoadModel(engine_pb2.LoadModelRequest(name="not-a-sim-model", warmup=True))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "not-a-sim-model" in err.value.details() and "must start with 'sim'" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.LoadModel(engine_pb2.LoadModelRequest(name="sim-x", adapter_path="/nowhere"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "LoRA" in err.value.details()
        assert await text_of(stub, ask("sim-a"))


async def test_the_llamacpp_engine_reports_a_missing_model_and_keeps_serving(engine, real_model_dir):
    stub, ch = await engine(backend="llamacpp", model="smollm2-135m-instruct", model_dir=real_model_dir,
                            max_running=2, n_ctx=512)
    async with ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.LoadModel(engine_pb2.LoadModelRequest(name="no-such-gguf", warmup=True))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        again = await stub.LoadModel(engine_pb2.LoadModelRequest(name="smollm2-135m-instruct", warmup=True))
        assert again.model.context_length == 512 and not again.replaced  # already served: nothing to do
        assert await text_of(stub, ask("smollm2-135m-instruct"))

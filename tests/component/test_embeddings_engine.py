"""The minilm engine on the real all-MiniLM-L6-v2, served over gRPC: Engine.Embed returns
sentence-transformers' vectors, refuses what it must (an input over the model's tokens, the
proto's bounds, dimensions), Generate is refused on it as Embed is on a generative engine;
and what it serves reaches the gateway's picker through the real scheduler, so only
embeddings requests go there and only generative ones to the sim engine beside it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from llmesh.engine.app import EngineApp
from llmesh.engine.config import EngineSettings
from llmesh.gateway.upstream.feed import SchedulerFeed
from llmesh.gateway.upstream.picking import EndpointPicker, PickInput
from llmesh.rpc.channels import mesh_channel
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings
from llmesh.testing import free_ports, wait_until_async
from llmesh.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

EMBED = "all-minilm-l6-v2"
REFERENCE = json.loads((Path(__file__).resolve().parents[1] / "data" / "minilm_reference.json").read_text())


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_embed_on_the_minilm_engine_and_picking_by_kind(real_model_dir):
    scheduler = SchedulerApp(SchedulerSettings(port=0, host="127.0.0.1"))
    await scheduler.start()
    common = dict(host="127.0.0.1", scheduler_address=scheduler.advertise_address, self_test_interval_s=600,
                  report_interval_s=0.2)
    embedder = EngineApp(EngineSettings(port=free_ports(1)[0], endpoint_id="embedder", backend="minilm", model=EMBED,
                                        model_dir=real_model_dir, **common))
    sim = EngineApp(EngineSettings(port=free_ports(1)[0], endpoint_id="sim", backend="sim", model="sim-m", **common))
    picker = EndpointPicker()

    async def resolve() -> str:
        return scheduler.advertise_address

    feed = asyncio.create_task(SchedulerFeed(resolve, picker).run())
    try:
        for e in (embedder, sim):
            await e.start()
        assert await wait_until_async(lambda: len(picker.all()) == 2)
        async with mesh_channel(scheduler.advertise_address, "scheduler") as ch:
            table = await scheduler_pb2_grpc.SchedulerStub(ch).ListEndpoints(scheduler_pb2.ListEndpointsRequest())
        served = {e.endpoint_id: [(s.name, s.context_length, s.embeddings) for s in e.served] for e in table.endpoints}
        assert served == {"embedder": [(EMBED, 256, True)], "sim": [("sim-m", 4096, False)]}
        assert picker.embedding_models() == {EMBED} and picker.generative_models() == {"sim-m"}
        now = time.monotonic()
        assert picker.pick(PickInput(EMBED, now, embed=True)).endpoint_id == "embedder"
        assert picker.pick(PickInput(EMBED, now)) is None  # a chat request never goes to the embedder
        assert picker.pick(PickInput("sim-m", now, embed=True)) is None
        assert picker.pick(PickInput("sim-m", now)).endpoint_id == "sim"

        async with mesh_channel(embedder.server.bound_address, "engine") as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            resp = await stub.Embed(engine_pb2.EmbedRequest(model=EMBED, inputs=REFERENCE["texts"]), timeout=30)
            assert len(resp.embeddings) == len(REFERENCE["texts"]) and resp.usage.prompt_tokens > 0
            for got, expected in zip(resp.embeddings, REFERENCE["vectors"]):
                assert np.abs(np.asarray(got.values, np.float32) - np.asarray(expected, np.float32)).max() < 1e-5
            long = await _refused(stub.Embed(engine_pb2.EmbedRequest(model=EMBED, inputs=["ok", "word " * 300]),
                                             timeout=30))
            assert long.code() == grpc.StatusCode.INVALID_ARGUMENT and "256 tokens" in long.details()
            assert "input[1]" in long.details()
            empty = await _refused(stub.Embed(engine_pb2.EmbedRequest(model=EMBED), timeout=30))
            assert empty.code() == grpc.StatusCode.INVALID_ARGUMENT and "input" in empty.details()
            many = await _refused(stub.Embed(engine_pb2.EmbedRequest(model=EMBED, inputs=["x"] * 2049), timeout=30))
            assert many.code() == grpc.StatusCode.INVALID_ARGUMENT
            total = await _refused(stub.Embed(engine_pb2.EmbedRequest(model=EMBED, inputs=["word " * 198] * 2048),
                                              timeout=60))  # 200 tokens each, each within the limit
            assert total.code() == grpc.StatusCode.INVALID_ARGUMENT and "409600 tokens together" in total.details()
            dims = await _refused(stub.Embed(engine_pb2.EmbedRequest(model=EMBED, inputs=["x"], dimensions=64),
                                             timeout=30))
            assert dims.code() == grpc.StatusCode.INVALID_ARGUMENT and "dimensions" in dims.details()
            generate = stub.Generate(engine_pb2.GenerateRequest(model=EMBED, prompt="hi"), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as gen:
                await generate.read()
            assert gen.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "embedding model" in gen.value.details()
        async with mesh_channel(sim.server.bound_address, "engine") as ch:
            wrong = await _refused(engine_pb2_grpc.EngineStub(ch).Embed(
                engine_pb2.EmbedRequest(model="sim-m", inputs=["hi"]), timeout=30))
            assert wrong.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not serve embeddings" in wrong.details()
        ok, why, _ = await embedder.core.self_test()  # an embedder's self-test (and warm-up): one vector
        assert ok, why
    finally:
        feed.cancel()
        for e in (embedder, sim):
            await e.stop(0.5)
        await scheduler.stop(0.5)

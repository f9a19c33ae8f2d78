"""Engines report what they serve, with each model's context length and the requests
naming it in flight, on the report stream to the real scheduler, whose table reaches
the gateway's picker: a llama.cpp engine on the real model (its n_ctx, capped by the
model's trained context) and sim engines (the context length they are set to). The
gateway's context_fits filter then sends a long request only where it fits."""

from __future__ import annotations

import asyncio
import time

from llmesh.engine.app import EngineApp
from llmesh.engine.config import EngineSettings
from llmesh.gateway.upstream.feed import SchedulerFeed
from llmesh.gateway.upstream.picking import EndpointPicker, PickInput
from llmesh.rpc.channels import mesh_channel
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings
from llmesh.testing import free_ports, wait_until_async
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


async def test_engines_report_context_and_in_flight_and_the_gateway_picks_by_context(real_model_dir):
    scheduler = SchedulerApp(SchedulerSettings(port=0, host="127.0.0.1"))
    await scheduler.start()
    common = dict(host="127.0.0.1", scheduler_address=scheduler.advertise_address, self_test_interval_s=600,
                  report_interval_s=0.2)
    engines = [
        EngineApp(EngineSettings(port=free_ports(1)[0], endpoint_id="llama", backend="llamacpp",
                                 model="smollm2-135m-instruct", model_dir=real_model_dir, n_ctx=512, **common)),
        EngineApp(EngineSettings(port=free_ports(1)[0], endpoint_id="sim-short", backend="sim", model="sim-m",
                                 sim_context_length=256, sim_decode_ms_per_token=20, sim_output_tokens=50, **common)),
        EngineApp(EngineSettings(port=free_ports(1)[0], endpoint_id="sim-long", backend="sim", model="sim-m",
                                 sim_context_length=8192, **common)),
    ]
    picker = EndpointPicker()

    async def resolve() -> str:
        return scheduler.advertise_address

    feed = asyncio.create_task(SchedulerFeed(resolve, picker).run())
    try:
        for e in engines:
            await e.start()
        assert await wait_until_async(lambda: len(picker.all()) == 3)
        async with mesh_channel(scheduler.advertise_address, "scheduler") as ch:
            table = await scheduler_pb2_grpc.SchedulerStub(ch).ListEndpoints(scheduler_pb2.ListEndpointsRequest())
        served = {e.endpoint_id: [(s.name, s.context_length, s.base_model) for s in e.served] for e in table.endpoints}
        assert served == {"llama": [("smollm2-135m-instruct", 512, "")], "sim-short": [("sim-m", 256, "")],
                          "sim-long": [("sim-m", 8192, "")]}
        by_id = {e.endpoint_id: e for e in picker.all()}
        assert by_id["sim-long"].context == {"sim-m": 8192} and by_id["llama"].adapters == {}

        # a request in flight on sim-short shows in its reports
        async with mesh_channel(engines[1].server.bound_address, "engine") as ch:
            call = engine_pb2_grpc.EngineStub(ch).Generate(engine_pb2.GenerateRequest(
                model="sim-m", prompt="hello", sampling=common_pb2.SamplingParams(max_tokens=50)), timeout=10)
            first = await call.read()
            assert first.text
            assert await wait_until_async(lambda: scheduler.table.snapshot() and any(
                e.endpoint_id == "sim-short" and e.served[0].in_flight == 1 for e in scheduler.table.snapshot()))
            call.cancel()
        assert await wait_until_async(lambda: all(s.in_flight == 0 for e in scheduler.table.snapshot()
                                                  for s in e.served))

        # context_fits: 300 prompt tokens + 100 fit only sim-long; a short one fits both
        long_req = PickInput("sim-m", time.monotonic(), tokens=lambda: list(range(300)), max_tokens=100,
                             filters=("context_fits",))
        assert {picker.pick(long_req).endpoint_id for _ in range(20)} == {"sim-long"}
        short = PickInput("sim-m", time.monotonic(), tokens=lambda: list(range(30)), max_tokens=100,
                          filters=("context_fits",))
        assert {picker.pick(short).endpoint_id for _ in range(40)} == {"sim-short", "sim-long"}
    finally:
        feed.cancel()
        for e in engines:
            await e.stop(0.5)
        await scheduler.stop(0.5)


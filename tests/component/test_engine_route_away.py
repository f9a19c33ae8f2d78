"""An engine stopping with route_away_s (as the local autoscaler drains one): it leaves
the scheduler's table at once, yet a request routed to it just before still lands and is
answered; only after route_away_s does it stop accepting."""

from __future__ import annotations

import asyncio
import time


from llmesh.engine.app import EngineApp
from llmesh.engine.config import EngineSettings
from llmesh.rpc.channels import mesh_channel
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings
from llmesh.testing import free_ports
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc

MODEL = "sim-away"


def generate() -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id="r", model=MODEL, chat=engine_pb2.ChatInput(
        messages=[common_pb2.ChatMessage(role="user", content="hi")]), sampling=common_pb2.SamplingParams(max_tokens=2))


async def test_a_stopping_engine_leaves_routing_first_and_still_takes_what_was_routed():
    scheduler = SchedulerApp(SchedulerSettings(port=0, host="127.0.0.1"))
    await scheduler.start()
    engine = EngineApp(EngineSettings(backend="sim", model=MODEL, port=free_ports(1)[0], endpoint_id="away",
                                      scheduler_address=scheduler.advertise_address, route_away_s=0.6,
                                      self_test_interval_s=600, sim_output_tokens=2))
    await engine.start()
    channel = mesh_channel(engine.server.bound_address, "engine")
    stub = engine_pb2_grpc.EngineStub(channel)
    try:
        deadline = time.monotonic() + 5
        while not scheduler.table.snapshot() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert [e.endpoint_id for e in scheduler.table.snapshot()] == ["away"]

        stopping = asyncio.create_task(engine.stop(1.0))
        started = time.monotonic()
        while scheduler.table.snapshot() and time.monotonic() - started < 2:
            await asyncio.sleep(0.01)
        assert scheduler.table.snapshot() == []                 # out of routing ...
        assert time.monotonic() - started < 0.5
        answer = [r async for r in stub.Generate(generate(), timeout=5)]
        assert answer[-1].finish_reason                         # ... and still answering
        await stopping
        assert time.monotonic() - started >= 0.6
    finally:
        await channel.close()
        await scheduler.stop(0)


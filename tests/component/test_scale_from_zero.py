"""Scale from zero across the real scheduler and the gateway's parts: a request for a
scaled model with no replica is held by the cold-start stage, its demand reaches the
scheduler (DemandReporter -> ReportDemand), the autoscaler wants one replica (GetScale,
and the KEDA metrics), and when a replica registers (an engine's report stream, sent
here as an engine sends it) the held request goes on. Past hold_s it is refused with
Retry-After. Bad demand reports are INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import generate_latest

from llmesh.errors import Unavailable
from llmesh.gateway.context import Context
from llmesh.gateway.domain.holds import Holds
from llmesh.gateway.stages.coldstart import ColdStartStage
from llmesh.gateway.upstream.catalog import ScaledCatalog
from llmesh.gateway.upstream.demand import DemandReporter
from llmesh.gateway.upstream.feed import SchedulerFeed
from llmesh.gateway.upstream.picking import EndpointPicker, PickInput
from llmesh.liveconfig.schema import Autoscale, Autoscaling, MeshConfig
from llmesh.platform import standalone_platform
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings
from llmesh.types import Prompt
from llmesh.v1 import engine_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.component.helpers import completion_request

MODEL = "sim-cold"


def config(hold_s: float) -> MeshConfig:
    return MeshConfig(autoscaling=Autoscaling(hold_s=hold_s, retry_after_s=3, models={
        MODEL: Autoscale(max_replicas=2, idle_s=60, cooldown_s=60)}))


def request(timeout_s: float = 30) -> Context:
    return Context.of(completion_request(MODEL, prompt=Prompt(text="hi"), request_id="r1", timeout_s=timeout_s))


def engine_report() -> scheduler_pb2.EngineReport:
    return scheduler_pb2.EngineReport(endpoint_id="e1", address="127.0.0.1:9", backend="sim", models=[MODEL],
                                      load=engine_pb2.EngineLoad(max_running=4))


@pytest.fixture
async def mesh():
    platform = standalone_platform("scheduler")
    platform.config.current = config(hold_s=20)
    app = SchedulerApp(SchedulerSettings(port=0, host="127.0.0.1", autoscale_interval_s=0.1), platform)
    await app.start()
    picker = EndpointPicker()

    async def resolve() -> str:
        return app.advertise_address

    holds = Holds()
    tasks = [asyncio.create_task(SchedulerFeed(resolve, picker).run()),
             asyncio.create_task(DemandReporter(resolve, holds, "gw-1", interval_s=0.2).run())]
    channel = grpc.aio.insecure_channel(app.advertise_address)
    try:
        yield app, platform, picker, holds, scheduler_pb2_grpc.SchedulerStub(channel)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await channel.close()
        await app.stop(0)


def ready(picker: EndpointPicker):
    return lambda model: bool(picker.candidates(PickInput(model, time.monotonic())))


async def desired(stub) -> int:
    state = await stub.GetScale(scheduler_pb2.GetScaleRequest(), timeout=2)
    return next((m.desired for m in state.models if m.model == MODEL), -1)


async def test_a_held_request_goes_on_once_the_replica_it_asked_for_registers(mesh):
    app, platform, picker, holds, stub = mesh
    stage = ColdStartStage(ready(picker), holds, lambda: platform.config.current)
    assert await desired(stub) == 0
    ctx = request()
    held = asyncio.create_task(stage.admit(ctx))
    deadline = time.monotonic() + 5
    while await desired(stub) != 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert await desired(stub) == 1                       # the held request asked for a replica
    assert not held.done()
    metrics = generate_latest(platform.metrics).decode()
    assert f'llmesh_scheduler_replicas{{kind="desired",model="{MODEL}"}} 1.0' in metrics
    assert f'llmesh_scheduler_queue_depth{{model="{MODEL}"}} 1.0' in metrics

    engine = asyncio.Queue()
    engine.put_nowait(engine_report())

    async def reports():
        while (item := await engine.get()) is not None:
            yield item

    call = stub.Report(reports())
    await asyncio.wait_for(held, 5)                       # the replica is in the table: it goes on
    assert ctx.record.held_ms > 0
    assert holds.snapshot() == {}
    engine.put_nowait(None)
    await call


async def test_past_hold_s_the_request_is_refused_with_retry_after(mesh):
    app, platform, picker, holds, stub = mesh
    platform.config.current = config(hold_s=0.3)
    stage = ColdStartStage(ready(picker), holds, lambda: platform.config.current)
    started = time.monotonic()
    with pytest.raises(Unavailable) as info:
        await stage.admit(request())
    assert 0.3 <= time.monotonic() - started < 2
    assert info.value.reason == "scaling_up" and info.value.headers == {"retry-after": "3"}
    # ... and within the request's own timeout when that is shorter
    platform.config.current = config(hold_s=20)
    started = time.monotonic()
    with pytest.raises(Unavailable):
        await stage.admit(request(timeout_s=0.2))
    assert time.monotonic() - started < 1


async def test_unscaled_models_pass_and_scaled_ones_are_known(mesh):
    app, platform, picker, holds, stub = mesh
    stage = ColdStartStage(ready(picker), holds, lambda: platform.config.current)
    ctx = request()
    ctx.req = completion_request("other", prompt=Prompt(text="hi"), request_id="r2", timeout_s=5)
    await asyncio.wait_for(stage.admit(ctx), 0.5)         # not scaled: no hold, whatever its replicas
    assert ctx.record.held_ms is None

    class Nothing:
        def known(self, model): return False

    catalog = ScaledCatalog(Nothing(), lambda: platform.config.current)
    assert catalog.known(MODEL) and not catalog.known("other")


async def test_bad_demand_reports_are_invalid_argument(mesh):
    app, platform, picker, holds, stub = mesh
    for bad in (scheduler_pb2.ReportDemandRequest(held=[scheduler_pb2.HeldRequests(model=MODEL, count=1)]),
                scheduler_pb2.ReportDemandRequest(gateway_id="g", held=[scheduler_pb2.HeldRequests(count=1)])):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ReportDemand(bad, timeout=2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

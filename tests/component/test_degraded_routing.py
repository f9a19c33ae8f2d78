"""A degraded node stops getting work: the real scheduler, engines' report streams
(sent by this test as an engine sends them), and the gateway's feed and picker. One
node's GPU ECC count rises; within 2 s the gateway picks only the other, and the
scheduler's table (what `llmesh status` prints) says why."""

from __future__ import annotations

import asyncio
import time

import grpc

from llmesh.gateway.upstream.feed import SchedulerFeed
from llmesh.gateway.upstream.picking import EndpointPicker, PickInput
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings
from llmesh.v1 import engine_pb2, scheduler_pb2, scheduler_pb2_grpc

MODEL = "sim-small"


def report(eid: str, ecc: int) -> scheduler_pb2.EngineReport:
    return scheduler_pb2.EngineReport(
        endpoint_id=eid, address=f"127.0.0.1:{9000 + len(eid)}", backend="sim", models=[MODEL],
        load=engine_pb2.EngineLoad(running=0, waiting=0, max_running=4),
        hardware=scheduler_pb2.HardwareProfile(cpu_cores=2, gpus=[scheduler_pb2.GpuInfo(
            name="H100", ecc_errors_corrected=ecc)]),
        self_test=scheduler_pb2.SelfTest(ok=True, checked_unix=time.time(), latency_ms=20))


async def test_a_node_whose_ecc_errors_rise_gets_no_new_work_within_2_s():
    app = SchedulerApp(SchedulerSettings(port=0, host="127.0.0.1"))
    await app.start()
    channel = grpc.aio.insecure_channel(app.advertise_address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    queues = {eid: asyncio.Queue() for eid in ("sick", "fine")}

    async def stream(q):
        while (item := await q.get()) is not None:
            yield item

    calls = [stub.Report(stream(q)) for q in queues.values()]
    picker = EndpointPicker()

    async def resolve() -> str:
        return app.advertise_address

    feed = asyncio.create_task(SchedulerFeed(resolve, picker).run())
    try:
        for eid, q in queues.items():
            q.put_nowait(report(eid, ecc=3))
        deadline = time.monotonic() + 5
        while len(picker.all()) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        picks = {picker.pick(PickInput(MODEL, time.monotonic())).endpoint_id for _ in range(40)}
        assert picks == {"sick", "fine"}

        queues["sick"].put_nowait(report("sick", ecc=5))
        started = time.monotonic()
        while time.monotonic() - started < 2:
            picks = {picker.pick(PickInput(MODEL, time.monotonic())).endpoint_id for _ in range(40)}
            if picks == {"fine"}:
                break
            await asyncio.sleep(0.01)
        took = time.monotonic() - started
        assert picks == {"fine"} and took < 2, (picks, took)

        table = await stub.ListEndpoints(scheduler_pb2.ListEndpointsRequest(), timeout=2)
        why = {e.endpoint_id: e.degraded for e in table.endpoints}
        assert why["fine"] == "" and "GPU ECC errors rising (now 5)" in why["sick"]
    finally:
        feed.cancel()
        for q in queues.values():
            q.put_nowait(None)
        for call in calls:
            await call
        await channel.close()
        await app.stop(0.5)

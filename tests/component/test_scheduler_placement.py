"""Placement through the real scheduler: engines' report streams (sent by this test
as engines send them, with the GPUs and memory a fleet of GPU nodes would report),
the scheduler's Place RPC, and the model manager's client of it. A tensor-parallel
replica lands on k GPUs of one node or is refused with the right status and why;
unhealthy, degraded and avoided engines get nothing."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from llmesh.discovery.base import fixed
from llmesh.errors import ErrorCode, LlmeshError
from llmesh.modelmgr.clients import GrpcMesh
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings
from llmesh.v1 import engine_pb2, scheduler_pb2, scheduler_pb2_grpc

GIB = 2**30


def report(eid: str, gpus_free_gib=(), models=(), backend="vllm", ok=True, ram_gib=64, draining=False, tp=0):
    return scheduler_pb2.EngineReport(
        endpoint_id=eid, address=f"10.0.0.{len(eid)}:50051", backend=backend, models=list(models), replica_gpus=tp,
        load=engine_pb2.EngineLoad(max_running=4), draining=draining,
        hardware=scheduler_pb2.HardwareProfile(
            cpu_cores=32, memory_total_bytes=128 * GIB, memory_available_bytes=ram_gib * GIB,
            gpus=[scheduler_pb2.GpuInfo(name="H100", memory_total_bytes=80 * GIB,
                                        memory_used_bytes=int((80 - f) * GIB)) for f in gpus_free_gib]),
        self_test=scheduler_pb2.SelfTest(ok=ok, detail="" if ok else "NaN logits", checked_unix=time.time(),
                                         latency_ms=20))


FLEET = [
    report("node-a", (80, 80, 80, 80)),                 # 4 free H100s
    report("node-b", (80, 80, 5, 5)),                   # 2 with room, 2 nearly full
    report("node-c", (80, 80), models=["chat@1"]),      # serves a model an alias routes to
    report("node-d", (80, 80, 80, 80, 80, 80, 80, 80), ok=False),  # failing its self-test
    report("node-e", (80, 80, 80, 80), tp=2),           # 4 free H100s, but its vLLM runs a replica over 2
    report("cpu-1", (), backend="llamacpp", ram_gib=6),
    report("cpu-2", (), backend="llamacpp", ram_gib=20),
]


@pytest.fixture
async def scheduler():
    app = SchedulerApp(SchedulerSettings(port=0, host="127.0.0.1"))
    await app.start()
    channel = grpc.aio.insecure_channel(app.advertise_address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    queues = [asyncio.Queue() for _ in FLEET]

    async def stream(q):
        while (item := await q.get()) is not None:
            yield item

    calls = [stub.Report(stream(q)) for q in queues]
    for q, r in zip(queues, FLEET):
        q.put_nowait(r)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        table = await stub.ListEndpoints(scheduler_pb2.ListEndpointsRequest(), timeout=2)
        if len(table.endpoints) == len(FLEET):
            break
        await asyncio.sleep(0.02)
    try:
        yield app, stub
    finally:
        for q in queues:
            q.put_nowait(None)
        for call in calls:
            await call
        await channel.close()
        await app.stop(0.5)


async def place(stub, **kw):
    return (await stub.Place(scheduler_pb2.PlaceRequest(**kw), timeout=2)).placements


async def refusal(stub, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await place(stub, **kw)
    return exc.value.code(), exc.value.details()


async def test_gang_placement_through_the_scheduler(scheduler):
    _, stub = scheduler
    # 2 GPUs x 60 GiB: node-b's two roomy GPUs fit tighter than node-a's
    [p] = await place(stub, model="llama-70b", replicas=1, memory_bytes=120 * GIB, gpus_per_replica=2,
                      backends=["vllm"], avoid_models=["chat@1"])
    assert p.endpoint_id == "node-b" and not p.gpu_indices  # deprecated, never set: the engine picks its devices
    # 4 GPUs x 60 GiB: only node-a (node-d has 8 but fails its self-test)
    [p] = await place(stub, model="llama-70b", replicas=1, memory_bytes=240 * GIB, gpus_per_replica=4)
    assert p.endpoint_id == "node-a"
    # two such replicas: one node can (node-e has the room, but was started for 2 GPUs a replica), so none is
    code, why = await refusal(stub, model="llama-70b", replicas=2, memory_bytes=240 * GIB, gpus_per_replica=4,
                              backends=["vllm"])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "1 of 2 place(s)" in why and "node-b: 2 of its 4 GPU(s) have 60.0 GiB free; 4 needed" in why
    # 8 GPUs: only the sick node has them, and it gets no work
    code, why = await refusal(stub, model="big", replicas=1, memory_bytes=8 * GIB, gpus_per_replica=8)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "the most any eligible engine's node has is 4" in why
    # an engine serving a model an alias routes to is left alone
    code, why = await refusal(stub, model="m", replicas=3, memory_bytes=GIB, gpus_per_replica=1,
                              backends=["vllm"], avoid_models=["chat@1"])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "2 found" in why
    assert "left out, as they run a replica over another number of GPUs than 1: node-e" in why
    # node-e takes replicas of its own size
    placed = await place(stub, model="m", replicas=3, memory_bytes=120 * GIB, gpus_per_replica=2, backends=["vllm"],
                         avoid_models=["chat@1"])
    assert [p.endpoint_id for p in placed] == ["node-b", "node-a", "node-e"]
    # the engine already serving a model keeps its replica (no GPUs taken anew)
    [p] = await place(stub, model="chat@1", replicas=1, memory_bytes=GIB, gpus_per_replica=1)
    assert (p.endpoint_id, p.already_serving) == ("node-c", True)
    code, _ = await refusal(stub, model="m", replicas=0, memory_bytes=GIB)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def test_the_model_managers_client_places_in_cpu_memory(scheduler):
    app, _ = scheduler
    mesh = GrpcMesh(fixed(app.advertise_address))
    try:
        targets = await mesh.place("smol@1", 1, 4 * GIB, ("llamacpp",), 0, set())
        assert [t.endpoint_id for t in targets] == ["cpu-1"]          # the tighter fit
        targets = await mesh.place("smol@1", 2, 4 * GIB, ("llamacpp",), 0, set())
        assert sorted(t.endpoint_id for t in targets) == ["cpu-1", "cpu-2"]
        with pytest.raises(LlmeshError) as exc:
            await mesh.place("smol@1", 2, 8 * GIB, ("llamacpp",), 0, set())
        assert exc.value.code is ErrorCode.RESOURCE_EXHAUSTED and "cpu-1: 6.0 GiB memory free" in exc.value.message
    finally:
        await mesh.close()

"""Priority lanes on a real llama.cpp engine (SmolLM2, one running slot) over gRPC: a
high-priority request sent after a queue of low-priority ones starts and finishes
before them, and when the queue is full it takes the place of the newest low one; the
llama.cpp runner's own slot queue keeps the same order. The gateway's engine client
carries the class; an unknown class is refused."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import replace

import grpc
import pytest
from opentelemetry.trace import INVALID_SPAN

from llmesh.platform import standalone_platform
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.status import REASON_KEY
from llmesh.testing import free_ports, wait_until_async
from llmesh.types import Message, Priority, Prompt
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from llmesh.engine.app import EngineApp
from llmesh.engine.backends.base import DecodeParams
from llmesh.engine.backends.llamacpp import LlamaCppBackend
from llmesh.gateway.upstream.engines import EngineClients
from llmesh.engine.config import EngineSettings
from tests.component.helpers import completion_request

MODEL = "smollm2-135m-instruct"
LOW, HIGH = common_pb2.PRIORITY_LOW, common_pb2.PRIORITY_HIGH


@pytest.fixture
async def engine(real_model_dir):
    started = []

    async def start(max_waiting: int, **fields):
        platform = standalone_platform("engine")
        fields = {"model_dir": real_model_dir, "model": MODEL, "n_ctx": 512, "n_threads": 1, **fields}
        settings = EngineSettings(port=free_ports(1)[0], endpoint_id="lanes", scheduler_address=None,
                                  max_running=1, max_waiting=max_waiting, self_test_interval_s=600, **fields)
        app = EngineApp(settings, platform)
        await app.start()
        channel = mesh_channel(app.server.bound_address, "engine")
        started.append((app, channel))
        return app, engine_pb2_grpc.EngineStub(channel), platform

    yield start
    for app, channel in started:
        await channel.close()
        await app.stop(0)


class Log:
    """When each request saw its first token and its end, on one clock."""

    def __init__(self):
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.running = asyncio.Event()

    async def send(self, stub, name: str, priority: int, max_tokens: int) -> None:
        req = engine_pb2.GenerateRequest(
            request_id=name, model=MODEL, priority=priority,
            chat=engine_pb2.ChatInput(messages=[common_pb2.ChatMessage(
                role="user", content="Count from 1 to 200, one number per line.")]),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0))
        async for _ in stub.Generate(req, timeout=60):
            if name not in self.first:
                self.first[name] = time.monotonic()
                self.running.set()
        self.done[name] = time.monotonic()

    def by_first_token(self) -> list[str]:
        return sorted(self.first, key=self.first.get)


async def fill_queue(app, stub, log: Log, lows: int) -> list[asyncio.Task]:
    """One long low-priority request running, then ``lows`` short ones waiting behind it."""
    tasks = [asyncio.create_task(log.send(stub, "low0", LOW, 24))]
    await asyncio.wait_for(log.running.wait(), 30)
    for i in range(1, lows + 1):
        tasks.append(asyncio.create_task(log.send(stub, f"low{i}", LOW, 4)))
    assert await wait_until_async(lambda: app.admission.waiting == lows, 10.0, 0.005)
    assert "low0" not in log.done, "the running request ended before the queue filled; the test proves nothing"
    return tasks


async def test_a_high_priority_request_overtakes_queued_low_ones(engine):
    app, stub, _ = await engine(max_waiting=8)
    log = Log()
    lows = await fill_queue(app, stub, log, lows=3)
    high = asyncio.create_task(log.send(stub, "high", HIGH, 4))
    await asyncio.gather(*lows, high)
    assert log.by_first_token() == ["low0", "high", "low1", "low2", "low3"]
    assert log.done["high"] < min(log.first[f"low{i}"] for i in (1, 2, 3))  # finished before they started
    assert (app.admission.running, app.admission.waiting) == (0, 0)


async def test_a_full_queue_sheds_the_newest_low_request_for_a_high_one(engine):
    app, stub, platform = await engine(max_waiting=2)
    log = Log()
    low0, low1, low2 = await fill_queue(app, stub, log, lows=2)
    high = asyncio.create_task(log.send(stub, "high", HIGH, 4))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await low2
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(err.value.trailing_metadata())[REASON_KEY] == "shed"
    await asyncio.gather(low0, low1, high)
    assert log.by_first_token() == ["low0", "high", "low1"]
    shed = platform.metrics.get_sample_value("llmesh_engine_refused_requests_total",
                                             {"model_name": MODEL, "priority": "low", "reason": "shed"})
    assert shed == 1


async def test_the_batch_runner_itself_places_higher_classes_first(real_model_dir):
    """Past the engine's admission (a self-test, say), sequences waiting inside the llama.cpp
    runner for a KV slot also take it highest class first."""
    backend = LlamaCppBackend.from_store(real_model_dir, MODEL, n_ctx=512, n_threads=1, n_batch=256, n_slots=1)
    tokens = backend.tokenize(Prompt(messages=(Message("user", "Count from 1 to 200, one number per line."),)))
    first: dict[str, float] = {}
    running = asyncio.Event()

    async def run(name: str, priority: Priority, n: int):
        params = DecodeParams(n, 0.0, 1.0, 0, priority=priority)
        async with aclosing(backend.stream(tokens, params)) as pieces:
            async for _ in pieces:
                first.setdefault(name, time.monotonic())
                running.set()

    try:
        tasks = [asyncio.create_task(run("low0", Priority.LOW, 24))]
        await asyncio.wait_for(running.wait(), 30)
        for name, p in (("low1", Priority.LOW), ("normal", Priority.NORMAL), ("high", Priority.HIGH)):
            tasks.append(asyncio.create_task(run(name, p, 4)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
    finally:
        await backend.close()
    assert sorted(first, key=first.get) == ["low0", "high", "normal", "low1"]


async def test_the_gateway_client_carries_the_priority_to_the_engine(engine):
    """The gateway's engine client sends CompletionRequest.priority: a HIGH request it
    sends overtakes LOW ones it queued earlier on a one-slot (sim) engine."""
    app, _, _ = await engine(max_waiting=8, backend="sim", model="sim-lanes", sim_decode_ms_per_token=20)
    clients = EngineClients()
    first: dict[str, float] = {}
    running = asyncio.Event()

    async def send(name: str, priority: Priority, n: int) -> None:
        req = replace(completion_request("sim-lanes", name, request_id=name, timeout_s=30, max_tokens=n),
                      priority=priority)
        async with aclosing(clients.generate(app.server.bound_address, req, 30, INVALID_SPAN)) as items:
            async for _ in items:
                first.setdefault(name, time.monotonic())
                running.set()

    try:
        tasks = [asyncio.create_task(send("low0", Priority.LOW, 10))]
        await asyncio.wait_for(running.wait(), 10)
        tasks += [asyncio.create_task(send(f"low{i}", Priority.LOW, 2)) for i in (1, 2)]
        assert await wait_until_async(lambda: app.admission.waiting == 2, 10.0, 0.005)
        tasks.append(asyncio.create_task(send("high", Priority.HIGH, 2)))
        await asyncio.gather(*tasks)
    finally:
        await clients.close()
    assert sorted(first, key=first.get) == ["low0", "high", "low1", "low2"]


async def test_an_unknown_priority_is_invalid_argument(engine):
    _, stub, _ = await engine(max_waiting=1, backend="sim", model="sim-lanes", sim_decode_ms_per_token=1)
    req = engine_pb2.GenerateRequest(model="sim-lanes", prompt="hello", priority=9)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(req, timeout=10):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Unknown priority 9" in err.value.details()

"""The flow stage and its controller (services/gateway/stages/flow.py) on a fake upstream with a
fixed number of slots: a request waits for a slot instead of a 429; only queued requests are
ever preempted (429 with Retry-After and the reason), never one that has sent a byte; a request
still waiting at its deadline gets 504; flow control off wraps nothing."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from prometheus_client import CollectorRegistry

from llmesh.errors import DeadlineExceeded, FlowRefused
from llmesh.liveconfig.schema import FlowControl, MeshConfig, TenantPolicy
from llmesh.types import Delta, Finish, FinishReason, Priority, Prompt, Sampling, Usage
from llmesh.gateway.context import CompletionRequest, Context
from llmesh.gateway.metrics import FlowMetrics
from llmesh.gateway.stages.flow import FlowController, FlowStage


class Slots:
    """The engines as the picker sees them: ``total`` slots, ``used`` by requests in flight."""

    def __init__(self, total: int):
        self.total, self.used = total, 0

    def capacity(self, model: str, embed: bool, engine_queue: int) -> tuple[int, int, int]:
        return self.total - self.used, self.total, self.used


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def config(**flow) -> MeshConfig:
    return MeshConfig(flow_control=FlowControl(enabled=True, **flow))


def request(tenant: str, priority: Priority = Priority.NORMAL, timeout_s: float = 60.0) -> CompletionRequest:
    return CompletionRequest(request_id=f"{tenant}-{priority.name}", tenant=tenant, model="m",
                             prompt=Prompt(text="hello"), sampling=Sampling(max_tokens=16), timeout_s=timeout_s,
                             priority=priority)


class Upstream:
    """Streams one token, then waits for ``go`` before finishing; holds a slot meanwhile."""

    def __init__(self, slots: Slots):
        self.slots = slots
        self.go = asyncio.Event()

    def __call__(self, req: CompletionRequest):
        return self._answer()

    async def _answer(self):
        self.slots.used += 1
        try:
            yield Delta(text="a", tokens=1)
            await self.go.wait()
            yield Finish(FinishReason.STOP, Usage(1, 1))
        finally:
            self.slots.used -= 1

    def detached(self, req):
        raise AssertionError


async def start(stage: FlowStage, req: CompletionRequest, upstream: Upstream) -> tuple[asyncio.Task, list]:
    ctx = Context.of(req)
    await stage.admit(ctx)
    assert ctx.wraps is not None
    [wrap] = ctx.wraps
    got: list = []

    async def consume():
        async with aclosing(wrap(req, upstream)) as items:
            async for item in items:
                got.append(item)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)
    return task, got


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_request_waits_for_a_slot_instead_of_a_429():
    slots, cfg = Slots(1), config()
    flow = FlowController(lambda: cfg, slots.capacity)
    stage, up = FlowStage(flow, lambda: cfg), Upstream(slots)
    first, got1 = await start(stage, request("a"), up)
    await settle()
    second, got2 = await start(stage, request("b"), up)
    await settle()
    assert len(got1) == 1 and got2 == []  # the second waits: no slot, and no refusal
    up.go.set()
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert [type(i) for i in got2] == [Delta, Finish]


async def test_only_a_queued_request_is_preempted_never_one_that_sent_a_byte():
    slots, cfg = Slots(1), config(max_queued=1)
    flow = FlowController(lambda: cfg, slots.capacity)
    stage, up = FlowStage(flow, lambda: cfg), Upstream(slots)
    streaming, got = await start(stage, request("batch", Priority.LOW), up)
    await settle()
    assert len(got) == 1  # its first byte is out
    queued, _ = await start(stage, request("batch", Priority.LOW), up)
    await settle()
    critical, got_c = await start(stage, request("vip", Priority.HIGH), up)
    await settle()
    with pytest.raises(FlowRefused) as info:
        await asyncio.wait_for(queued, 5)
    assert info.value.reason == "preempted" and "higher class" in info.value.message
    assert int(info.value.headers["retry-after"]) >= 1
    assert not streaming.done()  # the streaming request was not touched
    up.go.set()
    await asyncio.wait_for(asyncio.gather(streaming, critical), 5)
    assert [type(i) for i in got] == [Delta, Finish] and [type(i) for i in got_c] == [Delta, Finish]


async def test_a_request_still_waiting_at_its_deadline_gets_504():
    slots, cfg, clock = Slots(1), config(), Clock()
    flow = FlowController(lambda: cfg, slots.capacity, clock=clock)
    stage, up = FlowStage(flow, lambda: cfg, clock=clock), Upstream(slots)
    holder, _ = await start(stage, request("a"), up)
    await settle()
    waiting, _ = await start(stage, request("b", timeout_s=2.0), up)
    await settle()
    clock.now = 1.9
    flow.tick()
    await settle()
    assert not waiting.done()
    clock.now = 2.0
    flow.tick()
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(waiting, 5)
    up.go.set()
    await asyncio.wait_for(holder, 5)


async def test_flow_control_off_wraps_nothing():
    cfg = MeshConfig()
    stage = FlowStage(FlowController(lambda: cfg, Slots(1).capacity), lambda: cfg)
    ctx = Context.of(request("a"))
    await stage.admit(ctx)
    assert ctx.wraps is None


async def test_a_model_without_known_endpoints_passes_through():
    slots, cfg = Slots(0), config()
    flow = FlowController(lambda: cfg, slots.capacity)
    stage, up = FlowStage(flow, lambda: cfg), Upstream(slots)
    up.go.set()
    task, got = await start(stage, request("a"), up)
    await asyncio.wait_for(task, 5)
    assert [type(i) for i in got] == [Delta, Finish]


class Recorder:
    def __init__(self):
        self.depth: dict[tuple[str, str], int] = {}
        self.waits: list[tuple[str, str]] = []
        self.refusals: list[tuple[str, str, str]] = []
        self.weights: dict[str, float] = {}

    def weighted(self, tenant, weight):
        self.weights[tenant] = weight

    def queued(self, model, tenant, klass, delta):
        self.depth[(tenant, klass)] = self.depth.get((tenant, klass), 0) + delta

    def waited(self, model, tenant, klass, seconds):
        self.waits.append((tenant, klass))

    def refused(self, model, tenant, klass, reason):
        self.refusals.append((tenant, klass, reason))


async def test_a_starved_batch_request_is_promoted_and_the_depth_follows_it():
    slots, clock, seen = Slots(1), Clock(), Recorder()
    cfg = MeshConfig(flow_control=FlowControl(enabled=True, classes={"batch": {"promote_after_s": 5}}))
    flow = FlowController(lambda: cfg, slots.capacity, clock=clock, metrics=seen)
    stage, up = FlowStage(flow, lambda: cfg, clock=clock), Upstream(slots)
    holder, _ = await start(stage, request("a"), up)
    await settle()
    starved, got = await start(stage, request("b", Priority.LOW), up)
    await settle()
    assert seen.depth == {("b", "batch"): 1}
    clock.now = 5.0
    flow.tick()
    assert seen.depth == {("b", "batch"): 0, ("b", "standard"): 1}  # waiting now as a standard request
    up.go.set()
    await asyncio.wait_for(asyncio.gather(holder, starved), 5)
    assert seen.depth[("b", "standard")] == 0 and ("b", "standard") in seen.waits
    assert [type(i) for i in got] == [Delta, Finish] and seen.refusals == []


async def test_a_client_gone_while_waiting_leaves_the_queue():
    slots, cfg, seen = Slots(1), config(), Recorder()
    flow = FlowController(lambda: cfg, slots.capacity, metrics=seen)
    stage, up = FlowStage(flow, lambda: cfg), Upstream(slots)
    holder, _ = await start(stage, request("a"), up)
    await settle()
    waiting, _ = await start(stage, request("b"), up)
    await settle()
    assert seen.depth == {("b", "standard"): 1}
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert seen.depth == {("b", "standard"): 0}
    up.go.set()
    await asyncio.wait_for(holder, 5)
    assert slots.used == 0 and seen.waits == [("a", "standard")]  # nothing was released for the one that left


async def test_a_waiting_tenants_weight_is_exported_beside_its_depth():
    slots, registry = Slots(1), CollectorRegistry()
    cfg = MeshConfig(flow_control=FlowControl(enabled=True), tenants={"b": TenantPolicy(weight=3)})
    flow = FlowController(lambda: cfg, slots.capacity, metrics=FlowMetrics(registry))
    stage, up = FlowStage(flow, lambda: cfg), Upstream(slots)
    holder, _ = await start(stage, request("a"), up)
    await settle()
    waiting, _ = await start(stage, request("b"), up)
    await settle()
    assert registry.get_sample_value("llmesh_flow_queued", {"model": "m", "tenant": "b", "class": "standard"}) == 1
    assert registry.get_sample_value("llmesh_flow_tenant_weight", {"tenant": "b"}) == 3.0
    assert registry.get_sample_value("llmesh_flow_tenant_weight", {"tenant": "a"}) is None  # it never waited
    up.go.set()
    await asyncio.wait_for(asyncio.gather(holder, waiting), 5)

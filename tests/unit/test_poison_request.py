"""The router and engines that go away under a request: one more engine at most, then
the request is refused (PoisonRequest, naming its id), before or after its first token,
never on a third engine or a fallback model; breakers count each loss. Engines here are
a fake client: what each address does is set per test."""

from __future__ import annotations

import time

import pytest

from llmesh.errors import EngineLost, PoisonRequest, Unavailable
from llmesh.liveconfig.schema import CircuitBreaker, MeshConfig, ModelPolicy
from llmesh.types import Delta, Finish, FinishReason, Message, Prompt, Sampling, Usage
from llmesh.gateway.context import CompletionRequest, Context
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker
from llmesh.gateway.upstream.resilience import Breakers

ENGINES = {"a1": "sim-a", "a2": "sim-a", "a3": "sim-a", "b1": "sim-b"}


class FakeEngines:
    """``behaviour[address]``: ok | lost (before any token) | lost_late (after one) | refuse."""

    def __init__(self, behaviour: dict[str, str]):
        self.behaviour = behaviour
        self.calls: list[str] = []

    async def generate(self, address, req, timeout_s, parent):
        self.calls.append(address)
        what = self.behaviour.get(address, "ok")
        if what == "lost":
            raise EngineLost(f"The engine at {address} went away during the call (Stream removed).")
        if what == "refuse":
            raise Unavailable("draining", reason="draining")
        yield Delta(text="one", tokens=1)
        if what == "lost_late":
            raise EngineLost(f"The engine at {address} went away during the call (Socket closed).")
        yield Finish(FinishReason.LENGTH, Usage(3, 2 if req.continuation else 1))


class Catalog:
    def known(self, model: str) -> bool:
        return model.startswith("sim-")


def setup(behaviour: dict[str, str], engines: dict[str, str] = ENGINES, busy: str | None = None
          ) -> tuple[Pipeline, FakeEngines, Breakers]:
    picker = EndpointPicker(down_for_s=0)
    picker.replace_all([Endpoint(endpoint_id=e, address=e, models=frozenset({m}), max_running=4)
                        for e, m in engines.items()])
    if busy is not None:
        picker.acquire(busy, 1000)  # looks loaded: tried last
    config = MeshConfig(models={"sim-a": ModelPolicy(max_attempts=3, fallbacks=["sim-b"])})
    breakers = Breakers(lambda: CircuitBreaker(failure_threshold=1))
    fake = FakeEngines(behaviour)
    return Pipeline(picker, fake, Catalog(), config=lambda: config, breakers=breakers), fake, breakers


def request() -> CompletionRequest:
    return CompletionRequest(request_id="req-42", tenant="t", model="sim-a", timeout_s=10,
                             prompt=Prompt(messages=(Message("user", "hello"),)), sampling=Sampling(max_tokens=3))


async def run(pipeline: Pipeline) -> tuple[list, Context]:
    ctx = Context.of(request())
    items = []
    async for item in pipeline.run(ctx.req, ctx):
        items.append(item)
    return items, ctx


async def test_a_second_engine_lost_refuses_the_request_naming_its_id():
    pipeline, engines, breakers = setup({"a1": "lost", "a2": "lost", "a3": "lost", "b1": "lost"})
    ctx = Context.of(request())
    with pytest.raises(PoisonRequest) as info:
        async for _ in pipeline.run(ctx.req, ctx):
            pass
    assert len(engines.calls) == 2  # max_attempts 3 and a fallback model: neither is used
    assert "b1" not in engines.calls
    assert info.value.reason == "poison_request" and "req-42" in info.value.message
    assert ctx.record.engines_lost == 2 and ctx.record.status == "invalid_argument"
    assert breakers.refusing(time.monotonic()) == frozenset(engines.calls)  # each loss counted


async def test_one_engine_lost_then_another_answers():
    pipeline, engines, _ = setup({"a1": "lost"}, {"a1": "sim-a", "ok": "sim-a"}, busy="ok")
    items, ctx = await run(pipeline)
    assert engines.calls == ["a1", "ok"]
    assert isinstance(items[-1], Finish) and ctx.record.engines_lost == 1 and ctx.record.status == "ok"


async def test_refusals_are_not_losses_and_use_every_attempt():
    pipeline, engines, _ = setup({"a1": "refuse", "a2": "refuse", "a3": "refuse"})
    items, ctx = await run(pipeline)
    assert len(engines.calls) == 4 and engines.calls[-1] == "b1"  # three refusals, then the fallback answers
    assert ctx.record.engines_lost == 0 and ctx.record.fallback == "sim-b"


async def test_a_loss_mid_stream_counts_too():
    pipeline, engines, _ = setup({"a1": "lost_late", "a2": "lost_late", "a3": "lost_late"})
    ctx = Context.of(request())
    got = []
    with pytest.raises(PoisonRequest):
        async for item in pipeline.run(ctx.req, ctx):
            got.append(item)
    assert len(engines.calls) == 2 and ctx.record.failovers == 1 and ctx.record.engines_lost == 2
    assert [type(i) for i in got] == [Delta, Delta]  # the first leg's token and the continuation's

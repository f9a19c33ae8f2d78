"""The router and engines that go away under a request (a poison pill kills whatever engine
it lands on). Before the first token: the request goes to no other engine while the one it
was on may come back; back within the hold, it is tried there once more, and a second loss
refuses it (PoisonRequest, naming its id): one engine killed, twice, never a second engine
nor a fallback model's. Not back within the hold (or the deadline first): an ordinary retry
elsewhere (or 504). After the first token: the answer goes on on another replica, and a
second loss refuses it. Breakers count each loss.

The engines are a fake client (named so) and the scheduler's table a fake fleet: an engine
that dies leaves the table (its report stream ends) and comes back after a restart delay,
as `llmesh up` and the scheduler make it; what each address does is set per test."""

from __future__ import annotations

import asyncio
import pytest

from llmesh.errors import DeadlineExceeded, EngineLost, PoisonRequest, Unavailable
from llmesh.liveconfig.schema import CircuitBreaker, MeshConfig, ModelPolicy
from llmesh.types import Delta, Finish, FinishReason, Message, Prompt, Sampling, Usage
from llmesh.gateway.context import CompletionRequest, Context
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker
from llmesh.gateway.upstream.resilience import Breakers, BreakerState

ENGINES = {"a1": "sim-a", "a2": "sim-a", "a3": "sim-a", "b1": "sim-b"}


class FakeFleet:
    """The table a scheduler would feed the picker. An engine that dies is gone from the
    table after ``leave_s`` (its report stream ended) and back after ``restart_s`` (None:
    never); a call to a dead engine is refused (a plain Unavailable, not a loss)."""

    def __init__(self, picker: EndpointPicker, engines: dict[str, str], restart_s: float | None = 0.05,
                 leave_s: float = 0.0):
        self.picker, self.engines, self.restart_s, self.leave_s = picker, engines, restart_s, leave_s
        self.alive = set(engines)
        self.deaths: list[str] = []
        self.publish()

    def publish(self) -> None:
        self.picker.replace_all([Endpoint(endpoint_id=e, address=e, models=frozenset({m}), max_running=4)
                                 for e, m in self.engines.items() if e in self.alive])

    def die(self, address: str) -> None:
        self.alive.discard(address)
        self.deaths.append(address)
        loop = asyncio.get_running_loop()
        loop.call_later(self.leave_s, self.publish)
        if self.restart_s is not None:
            loop.call_later(self.restart_s, self.revive, address)

    def revive(self, address: str) -> None:
        self.alive.add(address)
        self.publish()


class FakeEngines:
    """``behaviour[address]``: ok | poison (dies before any token, every time) | dies_once
    (before any token, the first time) | lost_late (dies after one token) | refuse."""

    def __init__(self, behaviour: dict[str, str]):
        self.behaviour = behaviour
        self.calls: list[str] = []
        self.fleet: FakeFleet | None = None
        self.proxied = False
        self.breaker_moves: list[tuple[str, BreakerState]] = []  # what the breakers did (the test's record)
        self._died: set[str] = set()

    def connected(self, address: str) -> bool:
        """Connected to a live engine; behind a proxy, connected (to the proxy) whatever the engine."""
        assert self.fleet is not None
        return self.proxied or address in self.fleet.alive

    async def generate(self, address, req, timeout_s, parent):
        assert self.fleet is not None
        if address not in self.fleet.alive:
            raise Unavailable(f"failed to connect to {address}")
        self.calls.append(address)
        what = self.behaviour.get(address, "ok")
        if what == "poison" or (what == "dies_once" and address not in self._died):
            self._died.add(address)
            self.fleet.die(address)
            raise EngineLost(f"The engine at {address} went away during the call (Stream removed).")
        if what == "refuse":
            raise Unavailable("draining", reason="draining")
        yield Delta(text="one", tokens=1)
        if what == "lost_late":
            self.fleet.die(address)
            raise EngineLost(f"The engine at {address} went away during the call (Socket closed).")
        yield Finish(FinishReason.LENGTH, Usage(3, 2 if req.continuation else 1))


class Catalog:
    def known(self, model: str) -> bool:
        return model.startswith("sim-")


def setup(behaviour: dict[str, str], engines: dict[str, str] = ENGINES, busy: tuple[str, ...] = (),
          max_attempts: int = 3, hold_s: float = 5.0, restart_s: float | None = 0.05, leave_s: float = 0.0
          ) -> tuple[Pipeline, FakeEngines, Breakers]:
    picker = EndpointPicker(down_for_s=0)
    fake = FakeEngines(behaviour)
    fake.fleet = FakeFleet(picker, engines, restart_s, leave_s)
    for endpoint in busy:
        picker.acquire(endpoint, 1000)  # looks loaded: tried last
    config = MeshConfig(models={"sim-a": ModelPolicy(max_attempts=max_attempts, fallbacks=["sim-b"])})
    breakers = Breakers(lambda: CircuitBreaker(failure_threshold=1, reset_after_s=0.02),
                        on_state=lambda endpoint, state: fake.breaker_moves.append((endpoint, state)))
    return (Pipeline(picker, fake, Catalog(), config=lambda: config, breakers=breakers, lost_engine_hold_s=hold_s),
            fake, breakers)


def request(timeout_s: float = 10) -> CompletionRequest:
    return CompletionRequest(request_id="req-42", tenant="t", model="sim-a", timeout_s=timeout_s,
                             prompt=Prompt(messages=(Message("user", "hello"),)), sampling=Sampling(max_tokens=3))


async def run(pipeline: Pipeline, req: CompletionRequest | None = None) -> tuple[list, Context]:
    ctx = Context.of(req or request())
    items = []
    async for item in pipeline.run(ctx.req, ctx):
        items.append(item)
    return items, ctx


async def refused(pipeline: Pipeline, exc: type[Exception]) -> tuple[pytest.ExceptionInfo, Context, list]:
    ctx = Context.of(request())
    got: list = []
    with pytest.raises(exc) as info:
        async for item in pipeline.run(ctx.req, ctx):
            got.append(item)
    return info, ctx, got


async def test_a_poison_request_kills_one_engine_twice_and_is_refused_naming_its_id():
    pipeline, engines, breakers = setup({e: "poison" for e in ENGINES})
    info, ctx, _ = await refused(pipeline, PoisonRequest)
    first = engines.calls[0]
    assert engines.calls == [first, first]  # the same engine again, once it was back; no other one
    assert engines.fleet is not None and engines.fleet.deaths == [first, first]
    assert info.value.reason == "poison_request" and "req-42" in info.value.message
    assert ctx.record.engines_lost == 2 and ctx.record.status == "invalid_argument"
    assert ctx.record.retries == 1 and ctx.record.fallback is None
    opened = [endpoint for endpoint, state in engines.breaker_moves if state is BreakerState.OPEN]
    assert opened == [first, first]  # each loss counted: the breaker opened, let the retry probe, opened again


async def test_an_engine_that_comes_back_answers_the_request_it_lost():
    pipeline, engines, _ = setup({"a1": "dies_once"}, {"a1": "sim-a", "a2": "sim-a"}, busy=("a2",))
    items, ctx = await run(pipeline)
    assert engines.calls == ["a1", "a1"]  # a2 was free all along: the request waited for a1
    assert isinstance(items[-1], Finish) and ctx.record.status == "ok"
    assert ctx.record.engines_lost == 1 and ctx.record.endpoint == "a1"


async def test_the_retry_waits_for_a_new_incarnation_not_the_table_that_lags():
    # The table still lists the dead engine for a while (the scheduler has not seen its stream end),
    # and behind a proxy the channel stays connected: a retry then would be refused and sent
    # elsewhere. It waits until the engine left the table and came back.
    pipeline, engines, _ = setup({"a1": "dies_once"}, {"a1": "sim-a", "a2": "sim-a"}, busy=("a2",),
                                 leave_s=0.2, restart_s=0.3)
    engines.proxied = True
    items, ctx = await run(pipeline)
    assert engines.calls == ["a1", "a1"] and ctx.record.status == "ok"


async def test_the_same_engine_is_retried_even_when_max_attempts_is_spent():
    # max_attempts counts engines; the lost one's second try is not another engine. No fallback either.
    pipeline, engines, _ = setup({e: "poison" for e in ENGINES}, max_attempts=1)
    info, ctx, _ = await refused(pipeline, PoisonRequest)
    assert len(engines.calls) == 2 and len(set(engines.calls)) == 1 and "b1" not in engines.calls
    assert ctx.record.fallback is None


async def test_an_engine_not_back_within_the_hold_is_presumed_gone_and_the_request_goes_elsewhere():
    pipeline, engines, _ = setup({"a1": "dies_once"}, {"a1": "sim-a", "a2": "sim-a"}, busy=("a2",),
                                 hold_s=0.2, restart_s=None)
    items, ctx = await run(pipeline)
    assert engines.calls == ["a1", "a2"]  # an ordinary retry, after the hold
    assert isinstance(items[-1], Finish) and ctx.record.engines_lost == 1 and ctx.record.retries == 1


async def test_a_second_loss_after_the_hold_ran_out_refuses_too():
    pipeline, engines, _ = setup({"a1": "poison", "a2": "poison"}, {"a1": "sim-a", "a2": "sim-a"}, busy=("a2",),
                                 hold_s=0.1, restart_s=None)
    info, ctx, _ = await refused(pipeline, PoisonRequest)
    assert engines.calls == ["a1", "a2"] and ctx.record.engines_lost == 2


async def test_the_hold_ends_at_the_deadline():
    pipeline, engines, _ = setup({"a1": "dies_once"}, {"a1": "sim-a", "a2": "sim-a"}, busy=("a2",),
                                 hold_s=30, restart_s=None)
    ctx = Context.of(request(timeout_s=0.3))
    with pytest.raises(DeadlineExceeded):
        async for _ in pipeline.run(ctx.req, ctx):
            pass
    assert engines.calls == ["a1"]  # never a2: the deadline came first


async def test_refusals_are_not_losses_and_use_every_attempt():
    pipeline, engines, _ = setup({"a1": "refuse", "a2": "refuse", "a3": "refuse"})
    items, ctx = await run(pipeline)
    assert len(engines.calls) == 4 and engines.calls[-1] == "b1"  # three refusals, then the fallback answers
    assert ctx.record.engines_lost == 0 and ctx.record.fallback == "sim-b"


async def test_a_loss_mid_stream_goes_on_on_another_replica_and_a_second_refuses():
    pipeline, engines, _ = setup({"a1": "lost_late", "a2": "lost_late", "a3": "lost_late"})
    info, ctx, got = await refused(pipeline, PoisonRequest)
    assert len(set(engines.calls)) == 2 and len(engines.calls) == 2  # another replica at once, no hold
    assert ctx.record.failovers == 1 and ctx.record.engines_lost == 2
    assert [type(i) for i in got] == [Delta, Delta]  # the first leg's token and the continuation's


async def test_one_loss_mid_stream_is_finished_elsewhere():
    pipeline, engines, _ = setup({"a1": "lost_late"}, {"a1": "sim-a", "a2": "sim-a"}, busy=("a2",))
    items, ctx = await run(pipeline)
    assert engines.calls == ["a1", "a2"] and isinstance(items[-1], Finish)
    assert ctx.record.failovers == 1 and ctx.record.engines_lost == 1 and ctx.record.status == "ok"


def test_the_picker_gives_an_endpoint_a_new_incarnation_each_time_it_comes_back():
    picker = EndpointPicker()
    e = Endpoint(endpoint_id="e", address="e", models=frozenset({"m"}))
    picker.replace_all([e])
    first = picker.appeared("e")
    picker.replace_all([e, Endpoint(endpoint_id="f", address="f", models=frozenset({"m"}))])
    assert picker.appeared("e") == first  # still there: the same incarnation
    picker.replace_all([])
    assert picker.appeared("e") is None
    picker.replace_all([e])
    second = picker.appeared("e")
    assert second is not None and second != first
    unhealthy = Endpoint(endpoint_id="e", address="e", models=frozenset({"m"}), healthy=False)
    picker.replace_all([unhealthy])
    assert picker.appeared("e") is None
    picker.replace_all([e])
    assert picker.appeared("e") not in (None, first, second)

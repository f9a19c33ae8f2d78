"""Breakers, the retry budget and fallback chains in the gateway pipeline, against
real sim engines served in-process over gRPC (a dead engine is a closed port)."""

from __future__ import annotations

import time
from functools import partial

import pytest

from llmesh.errors import Unavailable
from llmesh.liveconfig.schema import CircuitBreaker, MeshConfig, ModelPolicy, RetryBudget
from llmesh.gateway.context import Context
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.upstream.engines import EngineClients
from llmesh.gateway.upstream.picking import EndpointPicker
from llmesh.gateway.upstream.resilience import Breakers, BreakerState, RetryBudgetGate
from llmesh.gateway.upstream.router import FALLBACK_HEADER
from tests.component.helpers import Catalog, collect, completion_request, dead_endpoint

request = partial(completion_request, max_tokens=3, temperature=0.5)


async def test_breaker_trips_on_a_failing_engine_and_recovers_half_open(engines):
    live = await engines("b", "sim-b")
    picker = EndpointPicker(down_for_s=0)  # only the breaker keeps traffic away
    picker.replace_all([dead_endpoint("a", "sim-b"), live])
    picker.acquire("b")  # b looks busier, so a is everyone's first choice
    moves, records = [], []
    clock = [0.0]
    cfg = CircuitBreaker(failure_threshold=3, reset_after_s=5)
    breakers = Breakers(lambda: cfg, on_state=lambda e, s: moves.append((e, s)))
    clients = EngineClients()
    pipeline = Pipeline(picker, clients, Catalog(prefix="sim-"), config=MeshConfig, breakers=breakers,
                        clock=lambda: clock[0], observe=records.append)
    try:
        for _ in range(3):
            text, *_ = await collect(pipeline, request("sim-b"))
            assert text and records[-1].retries == 1 and records[-1].endpoint == "b"  # a tried first
        assert moves == [("a", BreakerState.OPEN)]
        text, *_ = await collect(pipeline, request("sim-b"))  # open: a is not even tried
        assert text and records[-1].retries == 0 and records[-1].endpoint == "b"
        # a comes back (restarted elsewhere, as a pod gets a new address), same endpoint id.
        picker.replace_all([await engines("a", "sim-b"), live])
        clock[0] = 5.0
        text, *_ = await collect(pipeline, request("sim-b"))  # the half-open probe goes to a
        assert text and records[-1].endpoint == "a" and records[-1].retries == 0
        assert moves == [("a", BreakerState.OPEN), ("a", BreakerState.HALF_OPEN), ("a", BreakerState.CLOSED)]
    finally:
        await clients.close()


async def test_an_open_breaker_does_not_refuse_the_last_option():
    picker = EndpointPicker(down_for_s=0)
    picker.replace_all([dead_endpoint("only", "sim-p")])
    breakers = Breakers(lambda: CircuitBreaker(failure_threshold=1))
    breakers.record("only", False, None, time.monotonic())
    records, clients = [], EngineClients()
    pipeline = Pipeline(picker, clients, Catalog(prefix="sim-"), config=MeshConfig, breakers=breakers,
                        observe=records.append)
    try:
        with pytest.raises(Unavailable) as info:
            await collect(pipeline, request("sim-p"))
        assert info.value.reason != "no_healthy_endpoint" and records[-1].breaker_panic is True
    finally:
        await clients.close()


async def test_retry_budget_holds_under_a_failing_fleet():
    picker = EndpointPicker(down_for_s=0)
    picker.replace_all([dead_endpoint(f"d{i}", "sim-r") for i in range(3)])
    clients = EngineClients()
    config = MeshConfig(default=ModelPolicy(max_attempts=3),
                        circuit_breaker=CircuitBreaker(enabled=False),
                        retry_budget=RetryBudget(ratio=0.2, burst=2))
    records = []
    pipeline = Pipeline(picker, clients, Catalog(prefix="sim-"), config=lambda: config, observe=records.append,
                        budget=RetryBudgetGate(lambda: config.retry_budget))
    try:
        for _ in range(50):
            with pytest.raises(Unavailable):
                await collect(pipeline, request("sim-r"))
        retries = sum(r.retries for r in records)
        # Unbudgeted, each request would try all three engines: 100 retries on 50 requests.
        assert retries <= 0.2 * 50 + 2
        assert retries >= 0.2 * 50 - 1
        assert sum(r.retry_budget_exhausted for r in records) >= 35
    finally:
        await clients.close()


async def test_fallback_chain_when_every_engine_of_the_model_is_down(engines):
    backup = await engines("backup", "sim-backup")
    picker = EndpointPicker()
    picker.replace_all([dead_endpoint("main", "sim-main"), backup])
    clients = EngineClients()
    config = MeshConfig(models={"sim-main": ModelPolicy(fallbacks=["sim-none", "sim-backup"])})
    records = []
    pipeline = Pipeline(picker, clients, Catalog(prefix="sim-"), config=lambda: config, observe=records.append)
    try:
        ctx = Context.of(request("sim-main"))
        text = ""
        async for item in pipeline.run(ctx.req, ctx):
            text += getattr(item, "text", "")
        assert text
        assert ctx.headers[FALLBACK_HEADER] == "sim-backup"
        assert records[-1].fallback == "sim-backup" and records[-1].model == "sim-backup"
        assert records[-1].endpoint == "backup"
    finally:
        await clients.close()


async def test_context_window_fallback_to_a_larger_model(engines):
    small = await engines("small", "sim-small-ctx", sim_context_length=32)
    large = await engines("large", "sim-large-ctx", sim_context_length=4096)
    picker = EndpointPicker()
    picker.replace_all([small, large])
    clients = EngineClients()
    config = MeshConfig(models={"sim-small-ctx": ModelPolicy(fallbacks=["sim-large-ctx"])})
    records = []
    pipeline = Pipeline(picker, clients, Catalog(prefix="sim-"), config=lambda: config, observe=records.append)
    try:
        text, *_ = await collect(pipeline, request("sim-small-ctx"))  # short: the small model answers
        assert text and records[-1].model == "sim-small-ctx" and records[-1].fallback is None
        long = " ".join(["word"] * 100)
        text, *_ = await collect(pipeline, request("sim-small-ctx", long))
        assert text and records[-1].fallback == "sim-large-ctx" and records[-1].endpoint == "large"
    finally:
        await clients.close()

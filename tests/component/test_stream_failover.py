"""Mid-stream failover: the engine streaming an answer dies after some tokens; the
gateway continues the answer on another engine from the prompt plus the text the
client already has, and the client sees one whole, well-formed stream. Real sim
engines served in-process over gRPC; the killed one is stopped for real."""

from __future__ import annotations

from functools import partial

import pytest

from llmesh.errors import Unavailable
from llmesh.liveconfig.schema import MeshConfig, ModelPolicy
from llmesh.types import Delta
from llmesh.engine.backends.sim import _WORDS
from llmesh.gateway.context import Context
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.upstream.engines import EngineClients
from llmesh.gateway.upstream.picking import EndpointPicker
from llmesh.gateway.upstream.router import FAILOVER_HEADER
from tests.component.helpers import Catalog, completion_request

MODEL = "sim-failover"
LONG = {"sim_decode_ms_per_token": 20, "sim_output_tokens": 200}  # long answers, 20 ms a token
request = partial(completion_request, MODEL, "tell me a long story", timeout_s=20, temperature=0.7)


async def test_killing_the_engine_mid_stream_leaves_the_stream_whole(engines):
    picker = EndpointPicker()
    picker.replace_all([await engines("a", MODEL, **LONG), await engines("b", MODEL, **LONG)])
    clients, records = EngineClients(), []
    pipeline = Pipeline(picker, clients, Catalog(MODEL),
                        config=lambda: MeshConfig(default=ModelPolicy(max_attempts=2)), observe=records.append)
    ctx = Context.of(request(max_tokens=20))
    deltas, finishes, killed = [], [], None
    try:
        async for item in pipeline.run(ctx.req, ctx):
            if isinstance(item, Delta):
                deltas.append(item)
                if len(deltas) == 5:
                    killed = ctx.record.endpoint
                    await engines.apps[killed].stop(0)  # the engine dies with the answer a quarter done
            else:
                finishes.append(item)
    finally:
        await clients.close()
    text = "".join(d.text for d in deltas)
    words = text.split(" ")
    assert len(words) == 20 and all(w in _WORDS for w in words), text  # one answer, single-spaced, no gap
    assert len(finishes) == 1 and finishes[0].usage.completion_tokens == 20
    assert finishes[0].reason.value == "length"
    assert ctx.headers[FAILOVER_HEADER] == "1"
    assert records[-1].failovers == 1 and records[-1].status == "ok"
    assert records[-1].endpoint != killed


async def test_without_another_engine_the_stream_ends_with_the_error(engines):
    picker = EndpointPicker()
    picker.replace_all([await engines("only", MODEL, **LONG)])
    clients = EngineClients()
    pipeline = Pipeline(picker, clients, Catalog(MODEL), config=lambda: MeshConfig())
    got = 0
    try:
        with pytest.raises(Unavailable):
            async for item in pipeline.run(request(max_tokens=20)):
                got += 1
                if got == 3:
                    await engines.apps["only"].stop(0)
    finally:
        await clients.close()
    assert got >= 3

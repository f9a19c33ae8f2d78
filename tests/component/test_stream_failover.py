"""Mid-stream failover: the engine streaming an answer dies after some tokens; the
gateway continues the answer on another engine from the prompt plus the text the
client already has, and the client sees one whole, well-formed stream. Real sim
engines served in-process over gRPC; the killed one is stopped for real."""

from __future__ import annotations

import pytest

from llmesh.errors import Unavailable
from llmesh.liveconfig.schema import MeshConfig, ModelPolicy
from llmesh.types import Delta, Message, Prompt, Sampling
from llmesh.engine.app import EngineApp
from llmesh.engine.backends.sim import _WORDS
from llmesh.engine.config import EngineSettings
from llmesh.gateway.context import CompletionRequest, Context
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.upstream.engines import EngineClients
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker
from llmesh.gateway.upstream.router import FAILOVER_HEADER
from tests.component.test_pipeline_retry import free_port

MODEL = "sim-failover"


class Catalog:
    def known(self, model: str) -> bool:
        return model == MODEL


@pytest.fixture
async def engines():
    apps: dict[str, EngineApp] = {}

    async def start(endpoint_id: str) -> Endpoint:
        settings = EngineSettings(backend="sim", model=MODEL, port=free_port(), endpoint_id=endpoint_id,
                                  scheduler_address=None, sim_decode_ms_per_token=20, sim_output_tokens=200)
        app = apps[endpoint_id] = EngineApp(settings)
        await app.start()
        return Endpoint(endpoint_id=endpoint_id, address=app.server.bound_address, models=frozenset({MODEL}),
                        max_running=settings.max_running)

    start.apps = apps
    yield start
    for app in apps.values():
        await app.stop(0)


def request(max_tokens: int) -> CompletionRequest:
    return CompletionRequest(request_id="r", tenant="t", model=MODEL, timeout_s=20,
                             prompt=Prompt(messages=(Message("user", "tell me a long story"),)),
                             sampling=Sampling(max_tokens=max_tokens, temperature=0.7))


async def test_killing_the_engine_mid_stream_leaves_the_stream_whole(engines):
    picker = EndpointPicker()
    picker.replace_all([await engines("a"), await engines("b")])
    clients, records = EngineClients(), []
    pipeline = Pipeline(picker, clients, Catalog(), config=lambda: MeshConfig(default=ModelPolicy(max_attempts=2)),
                        observe=records.append)
    ctx = Context.of(request(20))
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
    picker.replace_all([await engines("only")])
    clients = EngineClients()
    pipeline = Pipeline(picker, clients, Catalog(), config=lambda: MeshConfig())
    got = 0
    try:
        with pytest.raises(Unavailable):
            async for item in pipeline.run(request(20)):
                got += 1
                if got == 3:
                    await engines.apps["only"].stop(0)
    finally:
        await clients.close()
    assert got >= 3

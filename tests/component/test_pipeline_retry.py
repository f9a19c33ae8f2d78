"""The gateway pipeline against real engines served in-process over gRPC: endpoint
choice, retry elsewhere before the first token, and the errors that surface."""

from __future__ import annotations

import time
from functools import partial

import pytest

from llmesh.errors import QueueFull, Unavailable
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.upstream.engines import EngineClients
from llmesh.gateway.upstream.picking import EndpointPicker, PickInput
from tests.component.helpers import Catalog, collect, completion_request, dead_endpoint

MODEL = "sim-retry"
request = partial(completion_request, MODEL, request_id="r1", max_tokens=5, temperature=0.5)


async def test_dead_endpoint_is_retried_elsewhere_and_marked_down(engines):
    live = await engines("live", MODEL)
    dead = dead_endpoint("dead", MODEL)
    picker = EndpointPicker()
    picker.replace_all([dead, live])
    clients = EngineClients()
    pipeline = Pipeline(picker, clients, Catalog(MODEL))  # default policy: 2 attempts
    try:
        picker.acquire("live")  # the dead one looks less loaded, so it is tried first
        text, finish, *_ = await collect(pipeline, request())
        assert text and finish.usage.completion_tokens == 5
        picker.release("live")
        for _ in range(4):
            text, finish, *_ = await collect(pipeline, request())
            assert text and finish.usage.completion_tokens == 5
        # Once refused, the dead endpoint is skipped without another attempt.
        assert picker.pick(PickInput(MODEL, time.monotonic())).endpoint_id == "live"
    finally:
        await clients.close()


async def test_full_engine_sends_the_request_to_the_next_one(engines):
    tight = await engines("tight", MODEL, max_running=1, max_waiting=0, sim_decode_ms_per_token=50)
    roomy = await engines("roomy", MODEL)
    picker = EndpointPicker()
    picker.replace_all([tight])
    clients = EngineClients()
    pipeline = Pipeline(picker, clients, Catalog(MODEL), retry_after_s=1.5)  # default policy: 2 attempts
    try:
        hold = pipeline.run(request())
        await anext(hold)  # tight's only slot is taken
        with pytest.raises(QueueFull) as info:
            await collect(pipeline, request())  # nowhere else to go: 429, come back later
        assert info.value.reason == "queue_full"
        assert info.value.headers == {"retry-after": "2", "retry-after-ms": "1500"}
        picker.replace_all([tight, roomy])
        picker.acquire("roomy")  # make tight look like the better choice
        picker.acquire("roomy")
        text, *_ = await collect(pipeline, request())
        assert text
        await hold.aclose()
    finally:
        await clients.close()


async def test_full_queues_with_the_rest_down_is_come_back_later(engines):
    """A full engine tried first and a dead one last: the request still hears 429 with
    Retry-After (there is capacity, busy), not the dead one's 503."""
    tight = await engines("tight", MODEL, max_running=1, max_waiting=0, sim_decode_ms_per_token=50)
    dead = dead_endpoint("dead", MODEL)
    picker = EndpointPicker()
    picker.replace_all([tight])
    clients = EngineClients()
    pipeline = Pipeline(picker, clients, Catalog(MODEL))
    try:
        hold = pipeline.run(request())
        await anext(hold)
        picker.replace_all([tight, dead])
        for _ in range(3):
            picker.acquire("dead")  # the dead one looks busiest: it is tried last
        with pytest.raises(QueueFull) as info:
            await collect(pipeline, request())
        assert info.value.headers["retry-after"] == "1"
        await hold.aclose()
    finally:
        await clients.close()


async def test_no_endpoint_at_all_is_unavailable():
    pipeline = Pipeline(EndpointPicker(), EngineClients(), Catalog(MODEL))
    with pytest.raises(Unavailable) as info:
        await collect(pipeline, request())
    assert info.value.reason == "no_healthy_endpoint"



class SmolTokens:
    """The gateway's tokenizers (``PromptTokens``), tokenizing every model's prompt with SmolLM2's
    GGUF vocabulary (the sim engines' model has no tokenizer that goes to a thread), counting the
    tokenizations done in place and those done on a thread."""

    def __init__(self, model_dir) -> None:
        from llmesh.gateway.domain.prompt_tokens import PromptTokens

        self.tokens, self.in_place, self.on_a_thread = PromptTokens(model_dir), 0, 0

    def __call__(self, model, prompt):
        self.in_place += 1
        return self.tokens("smollm2-135m-instruct", prompt)

    async def ahead(self, model, prompts):
        ids = await self.tokens.ahead("smollm2-135m-instruct", prompts)
        self.on_a_thread += ids is not None
        return ids


@pytest.mark.parametrize("system, on_a_thread, in_place", [("the harbour and the tides " * 60, 1, 0),
                                                            ("be brief", 0, 1)])
@pytest.mark.parametrize("limited", [False, True])
async def test_a_retried_request_is_tokenized_once_for_all_its_picks_a_long_one_off_the_loop(
        engines, real_model_dir, system, on_a_thread, in_place, limited):
    """With a token limit, the limits' count and the picks share one tokenization too."""
    from llmesh.gateway.domain.limits import LocalLimiter
    from llmesh.gateway.domain.tokens import TokenCounter
    from llmesh.gateway.stages.validate import ValidateStage
    from llmesh.gateway.stages.route import RouteStage
    from llmesh.gateway.stages.limits import LimitStage
    from llmesh.liveconfig.schema import MeshConfig

    live = await engines("live", MODEL)
    dead = dead_endpoint("dead", MODEL)
    picker = EndpointPicker()
    picker.replace_all([dead, live])
    picker.acquire("live")  # the dead one looks less loaded: it is picked first, then live on the retry
    clients, tokens = EngineClients(), SmolTokens(real_model_dir)
    config = MeshConfig.model_validate({"models": {MODEL: {"routing": "prefix_aware"}},  # its picks read tokens
                                        "rate_limits": {"t": {"tokens_per_minute": 10**6}} if limited else {}})
    stages = [ValidateStage(), RouteStage(Catalog(MODEL), lambda: config),
              LimitStage(LocalLimiter(), lambda: config, TokenCounter(tokens))]
    pipeline = Pipeline(picker, clients, Catalog(MODEL), config=lambda: config, prompt_tokens=tokens, stages=stages)
    try:
        text, finish, *_ = await collect(pipeline, request(system=system))
        assert text and finish.usage.completion_tokens == 5
        assert picker.pick(PickInput(MODEL, time.monotonic())).endpoint_id == "live"  # dead was tried, marked down
        assert (tokens.on_a_thread, tokens.in_place) == (on_a_thread, in_place)
    finally:
        tokens.tokens.close()
        await clients.close()


@pytest.mark.parametrize("policy, tokenized", [({"routing": "least_loaded"}, 0),
                                               ({"routing": "round_robin", "filters": ["context_fits"]}, 1),
                                               ({"routing": "least_loaded", "scorers": {"token_load": 1}}, 1),
                                               ({"routing": "prefix_aware"}, 1)])
async def test_a_long_prompt_is_tokenized_only_where_the_model_s_picks_read_its_tokens(
        engines, real_model_dir, policy, tokenized):
    """No token limit here: a policy whose scorers and filters never read the prompt's tokens (the
    default, least_loaded) leaves a long prompt untokenized; one that does has it tokenized once."""
    from llmesh.liveconfig.schema import MeshConfig

    picker = EndpointPicker()
    picker.replace_all([await engines("a", MODEL), await engines("b", MODEL)])
    clients, tokens = EngineClients(), SmolTokens(real_model_dir)
    config = MeshConfig.model_validate({"models": {MODEL: policy}})
    pipeline = Pipeline(picker, clients, Catalog(MODEL), config=lambda: config, prompt_tokens=tokens)
    try:
        text, finish, *_ = await collect(pipeline, request(system="the harbour and the tides " * 60))
        assert text and finish.usage.completion_tokens == 5
        assert tokens.on_a_thread + tokens.in_place == tokenized
    finally:
        tokens.tokens.close()
        await clients.close()

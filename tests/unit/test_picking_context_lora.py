"""The context_fits filter and the lora_affinity scorer on plain inputs, through the
picker, and their selection in live config."""

import random

import pytest
from pydantic import ValidationError

from llmesh.gateway.upstream.feed import endpoint_from_pb
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker, PickInput
from llmesh.gateway.upstream.picking.filters import ContextFits
from llmesh.gateway.upstream.picking.scorers import LoraAffinity
from llmesh.gateway.upstream.picking.types import LocalState, work_tokens
from llmesh.liveconfig.schema import MeshConfig, ModelPolicy
from llmesh.types import Prompt
from llmesh.v1 import scheduler_pb2


def ep(eid, ctx=None, adapters=None, models=("m",), running=0) -> Endpoint:
    return Endpoint(eid, f"127.0.0.1:{1000 + len(eid)}", frozenset(models), running=running, max_running=4,
                    context={} if ctx is None else {m: ctx for m in models}, adapters=adapters or {})


def ask(prompt_tokens=0, max_tokens=None, model="m", filters=("context_fits",), work=0) -> PickInput:
    return PickInput(model, 0.0, tokens=lambda: list(range(prompt_tokens)), max_tokens=max_tokens,
                     filters=filters, work_tokens=work)


def test_context_tokens_are_prompt_plus_the_completion_asked_for():
    assert ask(100, 50).context_tokens() == 150
    assert ask(100).context_tokens() == 101  # no max_tokens: the engine needs room for one token
    # no tokenizer for the model: the work estimate's prompt share (bytes / 3)
    prompt = Prompt(text="x" * 300)
    assert ask(0, 20, work=work_tokens(prompt, 20)).context_tokens() == 120
    assert ask(0, None, work=work_tokens(prompt, None)).context_tokens() == 101


def test_context_fits_keeps_endpoints_whose_context_holds_the_request():
    f, local = ContextFits(), LocalState()
    assert f.keep(ep("a", ctx=200), ask(100, 100), local)       # exactly full fits, as engines check it
    assert not f.keep(ep("a", ctx=199), ask(100, 100), local)
    assert f.keep(ep("a", ctx=None), ask(10_000, 100), local)   # unknown context: it may fit


def test_the_picker_applies_context_fits_only_when_selected_and_never_empties_the_candidates():
    picker = EndpointPicker(rng=random.Random(1))
    picker.replace_all([ep("short", ctx=256), ep("long", ctx=8192)])
    long_req = ask(300, 100)
    assert {picker.pick(long_req).endpoint_id for _ in range(20)} == {"long"}
    # not selected: both stay candidates
    assert {e.endpoint_id for e in picker.candidates(ask(300, 100, filters=()))} == {"short", "long"}
    # nothing fits: nothing is dropped (the engine's own check answers context_length_exceeded)
    assert {e.endpoint_id for e in picker.candidates(ask(9000, 100))} == {"short", "long"}


def test_lora_affinity_prefers_endpoints_already_running_the_adapter():
    cands = [ep("idle", adapters={"sql": 0}, models=("base", "sql")),
             ep("busy", adapters={"sql": 2}, models=("base", "sql")),
             ep("other", adapters={"chat": 3, "sql": 0}, models=("base", "chat", "sql"))]
    assert LoraAffinity().scores(cands, ask(model="sql"), LocalState()) == [0.0, 1.0, 0.0]
    assert LoraAffinity().scores(cands, ask(model="base"), LocalState()) == [0.0, 0.0, 0.0]  # a model: no opinion


def test_lora_affinity_weighed_against_load_in_a_policy():
    picker = EndpointPicker(rng=random.Random(2))
    picker.replace_all([ep("idle", adapters={"sql": 0}, models=("base", "sql")),
                        ep("active", adapters={"sql": 1}, models=("base", "sql"), running=1)])
    weights = {"lora_affinity": 1.0, "least_load": 1.0}
    assert picker.pick(ask(model="sql", filters=()), weights=weights).endpoint_id == "active"
    assert picker.pick(ask(model="sql", filters=()), weights={"least_load": 1.0}).endpoint_id == "idle"


def test_live_config_selects_the_filter_and_weighs_the_scorer():
    cfg = MeshConfig.model_validate({"models": {"m": {"routing": "least_loaded", "filters": ["context_fits"],
                                                      "scorers": {"lora_affinity": 0.5, "least_load": 1}}}})
    policy = cfg.models["m"]
    assert policy.filters == ["context_fits"] and policy.scorers["lora_affinity"] == 0.5
    assert ModelPolicy().filters == []  # off unless chosen: it may tokenize the prompt
    with pytest.raises(ValidationError):
        ModelPolicy.model_validate({"filters": ["fits_somehow"]})


def test_the_scheduler_table_entry_becomes_context_lengths_and_adapters():
    e = endpoint_from_pb(scheduler_pb2.Endpoint(endpoint_id="v", address="10.0.0.1:1", models=["base", "sql"], served=[
        scheduler_pb2.ServedModel(name="base", context_length=4096, in_flight=3),
        scheduler_pb2.ServedModel(name="sql", context_length=4096, base_model="base", in_flight=2)]))
    assert e.context == {"base": 4096, "sql": 4096} and e.adapters == {"sql": 2}
    bare = endpoint_from_pb(scheduler_pb2.Endpoint(endpoint_id="old", models=["m"]))  # an engine that says nothing
    assert bare.context == {} and bare.adapters == {}


def test_work_tokens_count_utf8_bytes_and_estimate_long_non_ascii_text_without_encoding_it():
    from llmesh.gateway.domain.tokens import utf8_size
    assert utf8_size("abc") == 3 and utf8_size("é中") == 5              # exact while short
    long_zh = "中" * (1 << 17)
    assert utf8_size(long_zh) == 3 * len(long_zh) == len(long_zh.encode())  # CJK: the estimate is exact
    assert utf8_size("a" * (1 << 20)) == 1 << 20                          # ASCII: exact at any size
    assert work_tokens(Prompt(text="x" * 300), 10) == 110

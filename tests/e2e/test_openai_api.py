"""The gateway's HTTP API driven by the official openai package against a real mesh."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import openai
import pytest

from llmesh.testing import wait_until
from llmesh.v1 import engine_pb2, engine_pb2_grpc, modelmgr_pb2, modelmgr_pb2_grpc
from tests.e2e.conftest import EMBEDDER, N_CTX, SMOL
from tests.e2e.tokenizer import chat_prompt_tokens, text_tokens

SKY = [{"role": "user", "content": "What color is the sky on a clear day?"}]


def gguf(model_dir):
    return next((model_dir / SMOL).glob("*.gguf"))


def engine_load(address: str) -> engine_pb2.EngineLoad:
    with grpc.insecure_channel(address) as ch:
        return engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=2).load


def test_models_lists_only_what_can_answer_and_the_first_one_chats(client, mesh):
    assert EMBEDDER in registered(mesh) and "unserved-model" in registered(mesh)
    models = client.models.list().data
    ids = [m.id for m in models]
    assert {SMOL, "sim-small"} <= set(ids) and ids == sorted(ids)
    assert EMBEDDER not in ids and "unserved-model" not in ids  # registered, but no engine serves them
    assert all(m.model_extra["capabilities"] == ["chat", "completions"] and m.owned_by == "llmesh" for m in models)
    answer = client.chat.completions.create(model=models[0].id, messages=SKY, max_tokens=4)
    assert answer.choices[0].message.content and answer.usage.completion_tokens >= 1


def test_models_follow_the_config_providers_autoscaling_and_aliases(client, live_config):
    live_config(json.dumps({
        "default": {"max_attempts": 2},
        "models": {"unserved-model": {"fallbacks": ["hosted"]}},
        "providers": {"local": {"base_url": "http://127.0.0.1:9/v1", "models": {"hosted": "remote-name"}}},
        "autoscaling": {"models": {"scaled-later": {"min_replicas": 0}}},
        "splits": {"ab": {"targets": [{"model": SMOL, "weight": 1}, {"model": "sim-small", "weight": 1}]},
                   "half-down": {"targets": [{"model": SMOL, "weight": 1}, {"model": "nowhere", "weight": 1}]}}}))
    owners = {m.id: m.owned_by for m in client.models.list()}
    assert {"hosted", "scaled-later", "unserved-model", "ab"} <= set(owners)
    assert owners["hosted"] == "local" and owners["ab"] == "llmesh"
    assert "half-down" not in owners and "nowhere" not in owners and EMBEDDER not in owners


def registered(mesh) -> set[str]:
    """What the model manager's registry holds."""
    with grpc.insecure_channel(mesh.layout.address("modelmgr")) as ch:
        return {m.name for m in modelmgr_pb2_grpc.ModelManagerStub(ch).ListModels(
            modelmgr_pb2.ListModelsRequest(), timeout=5).models}


def test_chat_answers_coherently_with_exact_usage(client, model_dir):
    resp = client.chat.completions.create(model=SMOL, messages=SKY, temperature=0, max_tokens=40)
    text = resp.choices[0].message.content
    assert "blue" in text.lower()
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == chat_prompt_tokens(gguf(model_dir), SKY)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    if resp.choices[0].finish_reason == "length":
        assert resp.usage.completion_tokens == 40
    assert abs(text_tokens(gguf(model_dir), text) - resp.usage.completion_tokens) <= 1


def test_stream_with_include_usage(client, model_dir):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chunks = list(client.chat.completions.create(
        model=SMOL, messages=messages, temperature=0, max_tokens=30, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "4" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    usage = usage_chunks[0].usage
    assert usage.prompt_tokens == chat_prompt_tokens(gguf(model_dir), messages)
    assert abs(text_tokens(gguf(model_dir), text) - usage.completion_tokens) <= 1
    # The same greedy request without streaming gives the same text.
    again = client.chat.completions.create(model=SMOL, messages=messages, temperature=0, max_tokens=30)
    assert again.choices[0].message.content == text


def test_max_tokens_cuts_with_length(client):
    resp = client.chat.completions.create(model=SMOL, messages=SKY, temperature=0.7, max_tokens=5)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5


def test_stop_sequence_ends_the_answer_before_it(client):
    full = client.chat.completions.create(model=SMOL, messages=SKY, temperature=0, max_tokens=40)
    text = full.choices[0].message.content
    word = "blue"
    assert word in text
    cut = client.chat.completions.create(model=SMOL, messages=SKY, temperature=0, max_tokens=40, stop=[word])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.index(word)]
    streamed = client.chat.completions.create(model=SMOL, messages=SKY, temperature=0, max_tokens=40,
                                              stop=[word, "never-seen"], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[:text.index(word)]


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model=SMOL, messages=SKY, temperature=0.9, max_tokens=24)
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    assert a == b and a


def test_text_completions(client):
    resp = client.completions.create(model=SMOL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert resp.object == "text_completion"
    assert resp.choices[0].text and resp.usage.completion_tokens <= 8
    streamed = client.completions.create(model=SMOL, prompt="The capital of France is", max_tokens=8,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == resp.choices[0].text


def test_greedy_answers_come_from_the_cache_the_second_time(client, mesh):
    q = [{"role": "user", "content": "Say hello to the cache."}]
    first = client.chat.completions.with_raw_response.create(model=SMOL, messages=q, temperature=0, max_tokens=12)
    time.sleep(0.3)  # the store happens after the response
    second = client.chat.completions.with_raw_response.create(model=SMOL, messages=q, temperature=0, max_tokens=12)
    assert first.parse().choices[0].message.content == second.parse().choices[0].message.content
    rid = second.headers["x-request-id"]
    log = (mesh.log_dir / "gateway.log").read_text().splitlines()
    line = next(json.loads(x) for x in log if rid in x and '"msg":"request"' in x)
    assert line["cache"] == "hit" and line["endpoint"] is None


def test_client_disconnect_frees_the_engine_slot(client, mesh):
    stream = client.chat.completions.create(model=SMOL, messages=SKY, temperature=0.8, max_tokens=1500,
                                            stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    address = mesh.layout.engine_address(0)
    assert wait_until(lambda: engine_load(address).running == 0, 8.0)


# ---- errors, each with OpenAI's error body and the right status ----

def test_invalid_parameter_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SMOL, messages=SKY, temperature=5)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"
    assert info.value.body["type"] == "invalid_request_error"


def test_malformed_json_is_400(mesh):
    r = httpx.post(mesh.layout.http_url + "/v1/chat/completions", content=b"{oops",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=SKY)
    assert info.value.body["code"] == "model_not_found"


def test_prompt_longer_than_context_is_400_with_both_numbers(client, model_dir):
    long = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SMOL, messages=long, max_tokens=10)
    msg = info.value.body["message"]
    assert str(N_CTX) in msg and str(chat_prompt_tokens(gguf(model_dir), long)) in msg
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SMOL, messages=SKY, max_tokens=N_CTX)
    assert str(N_CTX) in info.value.body["message"]


def test_full_engine_is_429(client, tight_engine):
    hold = client.chat.completions.create(model="sim-tight", messages=SKY, stream=True)
    next(iter(hold))  # the only slot is taken, and there is no queue
    try:
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="sim-tight", messages=SKY)
        assert info.value.status_code == 429
    finally:
        hold.close()
    assert wait_until(lambda: engine_load(tight_engine).running == 0, 3.0)


def test_model_without_healthy_endpoint_is_503(client):
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="unserved-model", messages=SKY)
    assert info.value.status_code == 503
    assert info.value.body["code"] == "no_healthy_endpoint"


def test_expired_deadline_is_504_and_frees_the_engine(client, tight_engine):
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="sim-tight", messages=SKY,
                                       extra_headers={"x-request-timeout": "0.3"})
    assert info.value.status_code == 504
    assert wait_until(lambda: engine_load(tight_engine).running == 0, 3.0)


def test_requests_beyond_capacity_wait_in_the_queue(client, mesh):
    """The llama.cpp engine decodes up to MAX_RUNNING (here 3) sequences together; the
    others queue and still complete."""
    from concurrent.futures import ThreadPoolExecutor

    address = mesh.layout.engine_address(0)
    ask = lambda i: client.chat.completions.create(  # noqa: E731
        model=SMOL, messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=40, temperature=0.5)
    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(ask, i) for i in range(5)]
        assert wait_until(lambda: (load := engine_load(address)).running == 3 and load.waiting >= 1, 10.0)
        results = [f.result() for f in futures]
    assert all(r.choices[0].message.content for r in results)
    assert engine_load(address).running == 0 and engine_load(address).waiting == 0


def test_kv_block_events_reach_the_scheduler(client, mesh, model_dir):
    """The llama.cpp engine publishes the chained hashes of the blocks it caches; the
    scheduler's view of engine-0 grows by the prompt's full blocks."""
    from tests.e2e.conftest import endpoints

    def blocks() -> int:
        return next(e.kv_blocks for e in endpoints(mesh) if e.endpoint_id == "engine-0")

    before = blocks()
    messages = [{"role": "system", "content": "You answer questions about tides. " * 20},
                {"role": "user", "content": "When is high tide?"}]
    client.chat.completions.create(model=SMOL, messages=messages, max_tokens=4, temperature=0)
    full_blocks = chat_prompt_tokens(gguf(model_dir), messages) // 16
    assert full_blocks >= 8
    assert wait_until(lambda: blocks() >= full_blocks, 5.0), (before, blocks(), full_blocks)

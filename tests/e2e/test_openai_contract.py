"""The rest of the OpenAI contract, with the official client on the real model:
logprobs, response_format enforced by constrained decoding, n choices, and a 400
naming every parameter the mesh cannot honour."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import SMOL

SKY = [{"role": "user", "content": "What color is the sky on a clear day?"}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}}}


def test_logprobs_are_present_and_sane(client):
    resp = client.chat.completions.create(model=SMOL, messages=SKY, temperature=0, max_tokens=8,
                                          logprobs=True, top_logprobs=3)
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy picks the most likely token
        assert t.bytes == list(t.token.encode())
        assert sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1.0 + 1e-4
    plain = client.chat.completions.create(model=SMOL, messages=SKY, temperature=0, max_tokens=8)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content


def test_streamed_logprobs_follow_the_text(client):
    chunks = list(client.chat.completions.create(model=SMOL, messages=SKY, temperature=0, max_tokens=8,
                                                 logprobs=True, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) == 8 and "".join(t.token for t in tokens) == text


def test_legacy_completions_logprobs(client):
    resp = client.completions.create(model=SMOL, prompt="The capital of France is", max_tokens=4,
                                     temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert "".join(lp.tokens) == resp.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def _many(fn, seeds):
    with ThreadPoolExecutor(len(seeds)) as pool:  # concurrent: the engine batches them
        return list(pool.map(fn, seeds))


def test_json_object_is_valid_json_every_time(client):
    """Free-form JSON from a 135M model may ramble past max_tokens (then the text is
    cut, as OpenAI's is); what it finishes always parses, and it is never prose."""
    def ask(seed):
        return client.chat.completions.create(
            model=SMOL, temperature=0.0 if seed == 0 else 0.3, seed=seed, max_tokens=64,
            response_format={"type": "json_object"},
            messages=[{"role": "user", "content": 'Output this JSON exactly: {"color": "blue"}'}])
    answers = _many(ask, [0, 1, 2])
    for resp in answers:
        text = resp.choices[0].message.content
        assert text.startswith("{"), text
        if resp.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_json_object_cut_by_max_tokens_says_length(client):
    """OpenAI's contract: JSON mode does not stretch max_tokens. An answer it cuts is
    incomplete JSON, and finish_reason "length" says so (streamed too), so a client
    knows not to parse it; the tokens it was given were all used."""
    ask = dict(model=SMOL, temperature=0.0, seed=0, max_tokens=5, response_format={"type": "json_object"},
               messages=[{"role": "user", "content": 'Output this JSON exactly: {"colors": ["blue", "green"]}'}])
    resp = client.chat.completions.create(**ask)
    text = resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5, (text, resp)
    assert text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 5
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(streamed)


def test_json_schema_is_matched_every_time(client):
    def ask(seed):
        return client.chat.completions.create(
            model=SMOL, temperature=1.0, seed=seed, max_tokens=64,
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": True}})
    for resp in _many(ask, [1, 2, 3]):
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)


def test_n_gives_that_many_choices(client):
    resp = client.chat.completions.create(model=SMOL, messages=SKY, temperature=1.0, seed=5, max_tokens=6, n=2)
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.message.content for c in resp.choices)
    assert resp.usage.completion_tokens == 12  # 6 each, both cut at max_tokens or fewer on a stop
    chunks = list(client.chat.completions.create(model=SMOL, messages=SKY, temperature=1.0, seed=5,
                                                 max_tokens=6, n=2, stream=True))
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert streamed == [c.message.content for c in resp.choices]  # the same seeds give the same answers


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),  # out of range
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"n": 99}, "n"),
])
def test_unsupported_parameters_are_a_400_naming_them(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SMOL, messages=SKY, max_tokens=2, **extra)
    assert info.value.body["param"] == param


def test_a_backend_that_cannot_constrain_says_so(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="sim-small", messages=SKY, max_tokens=2,
                                       response_format={"type": "json_object"})
    assert info.value.body["param"] == "response_format"


def test_grpc_chat_carries_logprobs(mesh):
    with grpc.insecure_channel(mesh.layout.address("gateway")) as ch:
        request = gateway_pb2.ChatRequest(model=SMOL, messages=[common_pb2.ChatMessage(role="user", content="Hi")],
                                          sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0, logprobs=1))
        replies = list(gateway_pb2_grpc.GatewayStub(ch).Chat(request, timeout=60))
    tokens = [t for r in replies for t in r.logprobs]
    assert len(tokens) == 4 and "".join(t.token for t in tokens) == "".join(r.text for r in replies)
    assert all(t.logprob <= 0 and len(t.top) == 1 for t in tokens)

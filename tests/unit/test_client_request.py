"""llmesh.client's pure parts: requests from keyword arguments, the retry policy."""

from __future__ import annotations

import grpc
import pytest

from llmesh.client.core import Deadline, RetryPolicy, build_request, call_metadata, gateway_methods
from llmesh.v1 import common_pb2, gateway_pb2


def chat_request(request=None, **fields) -> gateway_pb2.ChatRequest:
    return build_request(gateway_methods()["Chat"].request_type, request, fields)


def test_methods_come_from_the_gateway_descriptor():
    methods = gateway_methods()
    assert methods["Chat"].path == "/llmesh.v1.Gateway/Chat"
    assert methods["Chat"].request_type.DESCRIPTOR.full_name == "llmesh.v1.ChatRequest"
    assert methods["ListModels"].response_type.DESCRIPTOR.full_name == "llmesh.v1.GatewayListModelsResponse"


def test_keywords_land_on_the_request_and_its_sampling():
    req = chat_request(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.0, max_tokens=7,
                       stop=["\n"], response_format={"type": "json_object"})
    assert req.model == "m" and req.messages[0].content == "hi"
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 0.0  # set, not left unset
    assert req.sampling.max_tokens == 7 and list(req.sampling.stop) == ["\n"]
    assert req.sampling.response_format.type == "json_object"
    assert not req.sampling.HasField("seed")


def test_keywords_replace_the_fields_of_a_request():
    base = gateway_pb2.ChatRequest(model="m", messages=[common_pb2.ChatMessage(role="user", content="old")],
                                   sampling=common_pb2.SamplingParams(max_tokens=3, seed=1, stop=["a"]))
    req = chat_request(base, messages=[common_pb2.ChatMessage(role="system", content="be brief")],
                       max_tokens=9, stop=["b"], seed=None)
    assert req.model == "m" and [m.content for m in req.messages] == ["be brief"]  # replaced, not appended
    assert req.sampling.max_tokens == 9 and list(req.sampling.stop) == ["b"] and req.sampling.seed == 1
    assert base.sampling.max_tokens == 3 and len(base.messages) == 1  # the caller's message is not changed
    sampling = {"top_p": 0.5}
    req = chat_request(base, sampling=sampling, max_tokens=4)
    assert req.sampling.top_p == 0.5 and req.sampling.max_tokens == 4 and not req.sampling.HasField("seed")
    assert sampling == {"top_p": 0.5}


def test_unknown_keywords_and_bad_values_fail_before_a_call():
    with pytest.raises(TypeError, match="no field 'temprature'"):
        chat_request(model="m", temprature=1.0)
    with pytest.raises(ValueError, match="max_tokens"):
        chat_request(model="m", max_tokens=2**33)  # beyond uint32
    with pytest.raises(ValueError):
        chat_request(model="m", messages=[{"role": "user", "text": "hi"}])


def test_credentials_travel_as_bearer_metadata():
    assert call_metadata("llm_x", {"x-request-id": "r1"}) == (("authorization", "Bearer llm_x"),
                                                             ("x-request-id", "r1"))
    assert call_metadata(None, None) == ()


def test_only_unavailable_is_retried_within_attempts_and_deadline():
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=0.15)
    forever = Deadline(None)
    assert 0.05 <= policy.delay(grpc.StatusCode.UNAVAILABLE, 1, forever) <= 0.1
    assert policy.delay(grpc.StatusCode.UNAVAILABLE, 2, forever) <= 0.15  # capped
    assert policy.delay(grpc.StatusCode.UNAVAILABLE, 3, forever) is None  # attempts used up
    for code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL):
        assert policy.delay(code, 1, forever) is None
    assert policy.delay(grpc.StatusCode.UNAVAILABLE, 1, Deadline(0.01)) is None  # no time left to wait

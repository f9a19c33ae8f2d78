"""llmesh.client's pure parts: requests from keyword arguments, the retry policy, and answers
collected by choice."""

from __future__ import annotations

import grpc
import pytest

from llmesh.client.core import Deadline, Result, RetryPolicy, build_request, call_metadata, gateway_methods
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


def test_complete_requests_take_prompt_n_and_sampling_keywords():
    methods = gateway_methods()
    assert methods["Complete"].path == "/llmesh.v1.Gateway/Complete"
    req = build_request(methods["Complete"].request_type, None, {"model": "m", "prompt": "Once", "n": 2,
                                                                 "max_tokens": 5, "logprobs": 1})
    assert (req.model, req.prompt, req.n, req.sampling.max_tokens, req.sampling.logprobs) == ("m", "Once", 2, 5, 1)
    with pytest.raises(TypeError, match="no field 'messages'"):
        build_request(methods["Complete"].request_type, None, {"messages": []})


def alt(token: str) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token=token, logprob=-0.5)


def test_interleaved_choices_are_collected_by_index():
    usage0, usage1 = common_pb2.Usage(prompt_tokens=4, completion_tokens=2), common_pb2.Usage(prompt_tokens=4,
                                                                                           completion_tokens=1)
    stream = [gateway_pb2.ChatResponse(id="chatcmpl-r", index=1, role="assistant", model="m", text="Ja",
                                       logprobs=[alt("Ja")]),
              gateway_pb2.ChatResponse(id="chatcmpl-r", index=0, role="assistant", model="m", text="Ye",
                                       logprobs=[alt("Ye")]),
              gateway_pb2.ChatResponse(id="chatcmpl-r", index=1, finish_reason=common_pb2.FINISH_REASON_STOP,
                                       usage=usage1),
              gateway_pb2.ChatResponse(id="chatcmpl-r", index=0, text="s", logprobs=[alt("s")]),
              gateway_pb2.ChatResponse(id="chatcmpl-r", index=0, finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                       usage=usage0)]
    result = Result(responses=stream)
    assert [c.index for c in result.choices] == [0, 1]
    first, second = result.choices
    assert (first.text, first.role, first.finish_reason) == ("Yes", "assistant", common_pb2.FINISH_REASON_LENGTH)
    assert (second.text, second.finish_reason) == ("Ja", common_pb2.FINISH_REASON_STOP)
    assert [lp.token for lp in first.logprobs] == ["Ye", "s"] and [lp.token for lp in second.logprobs] == ["Ja"]
    assert first.usage == usage0 and second.usage == usage1
    # the single-choice view is choice 0's, never a mix of the choices' texts
    assert (result.text, result.finish_reason, result.usage) == ("Yes", common_pb2.FINISH_REASON_LENGTH, usage0)
    assert result.id == "chatcmpl-r" and result.model == "m" and result.last is stream[-1]


def test_streamed_tool_call_pieces_are_joined_per_choice_and_call():
    def piece(**kw) -> common_pb2.ToolCall:
        return common_pb2.ToolCall(**kw)
    stream = [gateway_pb2.ChatResponse(index=0, role="assistant", tool_calls=[piece(index=0, id="c0", name="f")]),
              gateway_pb2.ChatResponse(index=1, role="assistant", tool_calls=[piece(index=0, id="d0", name="g",
                                                                                      arguments='{"x"')]),
              gateway_pb2.ChatResponse(index=0, tool_calls=[piece(index=0, arguments='{"city": '),
                                                            piece(index=1, id="c1", name="h")]),
              gateway_pb2.ChatResponse(index=0, tool_calls=[piece(index=0, arguments='"Paris"}'),
                                                            piece(index=1, arguments="{}")]),
              gateway_pb2.ChatResponse(index=1, tool_calls=[piece(index=0, arguments=": 1}")],
                                       finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS),
              gateway_pb2.ChatResponse(index=0, finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS)]
    result = Result(responses=stream)
    assert [(c.index, c.id, c.name, c.arguments) for c in result.tool_calls] == [
        (0, "c0", "f", '{"city": "Paris"}'), (1, "c1", "h", "{}")]
    assert [(c.id, c.name, c.arguments) for c in result.choices[1].tool_calls] == [("d0", "g", '{"x": 1}')]
    assert stream[0].tool_calls[0].arguments == ""  # the streamed messages are left as they came
    assert result.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS and result.text == ""


def test_completion_responses_collect_without_roles_or_tool_calls():
    result = Result(responses=[gateway_pb2.CompleteResponse(id="cmpl-r", model="m", text=" upon"),
                               gateway_pb2.CompleteResponse(id="cmpl-r", text=" a time",
                                                            finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                                            usage=common_pb2.Usage(completion_tokens=3))])
    (choice,) = result.choices
    assert (choice.text, choice.role, choice.tool_calls) == (" upon a time", "", [])
    assert result.usage.completion_tokens == 3 and result.id == "cmpl-r"
    assert Result().text == "" and Result().choices == []


def test_the_sampling_knobs_are_keywords_too():
    req = build_request(gateway_pb2.ChatRequest, None, {"model": "m", "top_k": 3, "min_p": 0.5,
                                                        "repetition_penalty": 1.25, "presence_penalty": -1.0,
                                                        "frequency_penalty": 0.5})
    s = req.sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (3, 0.5, 1.25, -1.0,
                                                                                                 0.5)

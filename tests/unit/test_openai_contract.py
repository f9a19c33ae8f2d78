"""The OpenAI parameters beyond plain sampling: logprobs, response_format, n, and
refusing what the gateway does not do (never silently dropping it)."""

import asyncio
import json

import orjson
import pytest

from llmesh.convert import logprobs_from_pb, logprobs_to_pb, sampling_from_pb, sampling_to_pb
from llmesh.errors import InvalidArgument, Unavailable
from llmesh.types import Delta, Finish, FinishReason, ResponseFormat, Sampling, TokenLogprob, Usage
from llmesh.validation import check_request, check_sampling
from llmesh.gateway.context import CompletionRequest
from llmesh.gateway.fronts.choices import UsageSum, choice_requests, merge
from llmesh.gateway.fronts.openai_api import (CHAT, TEXT, ChatBody, Choice, ChunkWriter, CompletionBody,
                                              completion_json, parse)
from llmesh.types import Prompt

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def chat(**fields) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return orjson.dumps(body)


def test_chat_logprobs_map_to_the_number_of_alternatives():
    assert parse(ChatBody, chat()).sampling_params().logprobs is None
    assert parse(ChatBody, chat(logprobs=True)).sampling_params().logprobs == 0
    assert parse(ChatBody, chat(logprobs=True, top_logprobs=3)).sampling_params().logprobs == 3
    with pytest.raises(InvalidArgument) as info:
        parse(ChatBody, chat(top_logprobs=3)).sampling_params()
    assert info.value.param == "top_logprobs"
    with pytest.raises(InvalidArgument) as info:
        check_sampling(parse(ChatBody, chat(logprobs=True, top_logprobs=21)).sampling_params())
    assert info.value.param == "top_logprobs"


def test_legacy_completions_take_an_integer_logprobs():
    body = parse(CompletionBody, orjson.dumps({"model": "m", "prompt": "x", "logprobs": 2}))
    assert body.sampling_params().logprobs == 2


def test_response_formats_map_to_domain():
    assert parse(ChatBody, chat(response_format={"type": "text"})).sampling_params().response_format is None
    assert (parse(ChatBody, chat(response_format={"type": "json_object"})).sampling_params().response_format
            == ResponseFormat("json_object"))
    fmt = parse(ChatBody, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA, "strict": True}})).sampling_params().response_format
    assert fmt.type == "json_schema" and json.loads(fmt.schema) == SCHEMA
    check_sampling(Sampling(response_format=fmt))


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "xml"}, "response_format.type"),
])
def test_bad_response_formats_name_the_field(fmt, param):
    with pytest.raises(InvalidArgument) as info:
        parse(ChatBody, chat(response_format=fmt)).sampling_params()
    assert info.value.param == param


def test_schema_text_that_is_not_an_object_is_refused():
    with pytest.raises(InvalidArgument) as info:
        check_sampling(Sampling(response_format=ResponseFormat("json_schema", "[1]")))
    assert info.value.param == "response_format.json_schema.schema"


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"1": 5}), ("modalities", ["audio"]), ("made_up_field", 1), ("echo", True),
])
def test_unsupported_parameters_are_refused_by_name(field, value):
    with pytest.raises(InvalidArgument) as info:
        parse(ChatBody, chat(**{field: value})).sampling_params()
    assert info.value.param == field and field in info.value.message


WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tools_map_to_domain_and_engines_refuse_them_by_name():
    body = parse(ChatBody, chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}},
                                parallel_tool_calls=False))
    tools = body.tools_value()
    assert [t.name for t in tools.functions] == ["weather"] and tools.choice == "function"
    assert json.loads(tools.functions[0].parameters)["properties"]["city"] == {"type": "string"}
    assert tools.function == "weather" and tools.parallel is False
    check_request("m", body.prompt(), body.sampling_params(), tools=tools, tools_allowed=True)
    with pytest.raises(InvalidArgument) as info:  # an llmesh engine cannot call tools
        check_request("m", body.prompt(), body.sampling_params(), tools=tools)
    assert info.value.param == "tools"
    with pytest.raises(InvalidArgument) as info:  # a named function must be offered
        named = parse(ChatBody, chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}))
        check_request("m", named.prompt(), named.sampling_params(), tools=named.tools_value(), tools_allowed=True)
    assert info.value.param == "tool_choice"
    with pytest.raises(InvalidArgument) as info:  # text completions have no tools
        parse(CompletionBody, orjson.dumps({"model": "m", "prompt": "x", "tools": [WEATHER]})).sampling_params()
    assert info.value.param == "tools"


def test_a_tool_conversation_maps_to_domain():
    body = parse(ChatBody, chat(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=[WEATHER]))
    _, assistant, tool = body.prompt().messages
    assert assistant.content == "" and assistant.tool_calls[0].name == "weather"
    assert tool.tool_call_id == "call_1"
    check_request("m", body.prompt(), body.sampling_params(), tools=body.tools_value(), tools_allowed=True)


def test_off_values_and_harmless_fields_pass():
    body = parse(ChatBody, chat(presence_penalty=0, frequency_penalty=0, logit_bias={}, tools=[], store=False,
                                metadata={"k": "v"}, service_tier="auto"))
    assert body.sampling_params().max_tokens is None


KNOBS = {"top_k": 20, "min_p": 0.25, "repetition_penalty": 1.5, "presence_penalty": -0.5, "frequency_penalty": 2.0}


@pytest.mark.parametrize("body_cls, body", [(ChatBody, chat(**KNOBS)),
                                            (CompletionBody, orjson.dumps({"model": "m", "prompt": "x", **KNOBS}))])
def test_the_knobs_map_to_sampling_and_round_trip_through_protobuf(body_cls, body):
    s = parse(body_cls, body).sampling_params()
    check_sampling(s)
    assert {k: getattr(s, k) for k in KNOBS} == KNOBS == s.knobs()
    assert sampling_from_pb(sampling_to_pb(s)) == s
    off = parse(ChatBody, chat(top_k=-1, min_p=0, repetition_penalty=1, presence_penalty=0, frequency_penalty=0))
    assert off.sampling_params().knobs() == {}


@pytest.mark.parametrize("field, value", [
    ("top_k", -2), ("top_k", 1048577), ("top_k", 2**40), ("top_k", 1.5), ("min_p", -0.1), ("min_p", 1.01),
    ("repetition_penalty", 0), ("repetition_penalty", 10.5), ("presence_penalty", 2.5),
    ("frequency_penalty", -2.01), ("frequency_penalty", "lots"), ("min_p", 1e300),
])
def test_knobs_out_of_range_are_refused_by_name(field, value):
    with pytest.raises(InvalidArgument) as info:
        check_sampling(parse(ChatBody, chat(**{field: value})).sampling_params())
    assert info.value.param == field and field in info.value.message


def test_sampling_round_trips_through_protobuf():
    s = Sampling(max_tokens=4, logprobs=2, response_format=ResponseFormat("json_schema", json.dumps(SCHEMA)))
    assert sampling_from_pb(sampling_to_pb(s)) == s
    plain = Sampling(temperature=0.0)
    assert sampling_from_pb(sampling_to_pb(plain)) == plain
    items = (TokenLogprob("a", -0.5, (("a", -0.5), ("b", -1.5))),)
    back = logprobs_from_pb(logprobs_to_pb(items))
    assert back[0].token == "a" and back[0].top[1][0] == "b"
    assert back[0].logprob == pytest.approx(-0.5) and back[0].top[1][1] == pytest.approx(-1.5)


def test_completion_json_has_every_choice_with_logprobs():
    lp = [TokenLogprob("Hi", -0.1, (("Hi", -0.1), ("Hey", -2.0))), TokenLogprob("!", -0.3)]
    out = completion_json(CHAT, "r", "m", [Choice("Hi!", FinishReason.STOP, lp), Choice("Yo", FinishReason.LENGTH, [])],
                          Usage(3, 4))
    assert [c["index"] for c in out["choices"]] == [0, 1]
    content = out["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                          "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]},
                                           {"token": "Hey", "logprob": -2.0, "bytes": [72, 101, 121]}]}
    text = completion_json(TEXT, "r", "m", [Choice("Hi!", FinishReason.STOP, lp)], Usage(1, 2))
    assert text["choices"][0]["logprobs"] == {"tokens": ["Hi", "!"], "token_logprobs": [-0.1, -0.3],
                                              "top_logprobs": [{"Hi": -0.1, "Hey": -2.0}, {}], "text_offset": [0, 2]}
    body = completion_json(CHAT, "r", "m", [Choice("x", FinishReason.STOP, None)], Usage())
    assert body["choices"][0]["logprobs"] is None


def test_stream_chunks_carry_index_and_running_text_offsets():
    w = ChunkWriter(TEXT, "r", "m", include_usage=False, logprobs=True)
    w.delta("ab", 1, (TokenLogprob("ab", -1.0),))
    second = w.delta("c", 1, (TokenLogprob("c", -2.0),))
    assert second["choices"][0]["index"] == 1
    assert second["choices"][0]["logprobs"]["text_offset"] == [2]
    assert ChunkWriter(CHAT, "r", "m", False).delta("x")["choices"][0]["logprobs"] is None


def test_choice_requests_vary_the_seed_and_the_request_id():
    req = CompletionRequest("rid", "t", "m", Prompt(text="x"), Sampling(seed=7), 5.0)
    reqs = choice_requests(req, 3)
    assert [r.sampling.seed for r in reqs] == [7, 8, 9]
    assert len({r.request_id for r in reqs}) == 3
    assert choice_requests(req, 1) == [req]


async def _answer(words, delay, fail=False):
    for w in words:
        await asyncio.sleep(delay)
        yield Delta(w, 1)
    if fail:
        raise Unavailable("gone")
    yield Finish(FinishReason.STOP, Usage(5, len(words)))


async def test_merge_interleaves_choices_and_sums_usage():
    seen, total = {0: [], 1: []}, UsageSum()
    async for i, item in merge([_answer(["a", "b"], 0.01), _answer(["c", "d", "e"], 0.005)]):
        if isinstance(item, Delta):
            seen[i].append(item.text)
        else:
            total.add(item)
    assert seen == {0: ["a", "b"], 1: ["c", "d", "e"]}
    assert total.usage == Usage(5, 5)


async def test_merge_raises_the_first_failure_and_stops_the_others():
    closed = asyncio.Event()

    async def slow():
        try:
            yield Delta("x", 1)
            await asyncio.sleep(10)
        finally:
            closed.set()

    with pytest.raises(Unavailable):
        async for _ in merge([slow(), _answer(["a"], 0.01, fail=True)]):
            pass
    assert closed.is_set()


def _through_masker(pieces):
    from llmesh.gateway.domain.guards.pii import PiiMasker, Placeholders
    from llmesh.gateway.domain.guards.pii_stream import StreamMasker
    from llmesh.gateway.output import LogprobGate
    masker, gate, sent, out = StreamMasker(PiiMasker(), Placeholders()), LogprobGate(), [], []
    for piece in pieces:
        text = masker.feed(piece)
        sent.append(text)
        out.extend(gate.feed(piece, (TokenLogprob(piece, -0.5, ((piece, -0.5),)),), text))
    tail = masker.flush()
    sent.append(tail)
    out.extend(gate.feed("", (), tail, last=True))
    return "".join(sent), out


def test_logprobs_behind_a_clean_masked_answer_pass_unchanged():
    text, entries = _through_masker(["The", " sky", " is", " blue", "."])
    assert text == "The sky is blue."
    assert "".join(e.token for e in entries) == text and len(entries) == 5


def test_logprobs_never_leak_what_the_masker_hid():
    text, entries = _through_masker(["Mail", " me", " at", " bob", "@", "example", ".com", " now"])
    assert "bob@example.com" not in text
    assert len(entries) == 8 and all(e.logprob == -0.5 for e in entries)
    assert not any("bob" in e.token or "example" in e.token or any("example" in a for a, _ in e.top)
                   for e in entries)


def test_tool_calls_in_answers_and_chunks():
    from llmesh.types import ToolCall
    from llmesh.gateway.fronts.openai_api import ToolCalls
    pieces = [(ToolCall(0, "call_1", "weather", ""),), (ToolCall(0, "", "", '{"city":'),),
              (ToolCall(0, "", "", '"Paris"}'),)]
    joined = ToolCalls()
    for p in pieces:
        joined.add(p)
    answer = completion_json(CHAT, "r", "m", [Choice("", FinishReason.TOOL_CALLS, None, joined.json())], Usage(3, 4))
    message = answer["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}]}
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    writer = ChunkWriter(CHAT, "r", "m", include_usage=False)
    first = writer.delta("", 0, (), pieces[0])["choices"][0]["delta"]
    assert first == {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"arguments": "", "name": "weather"}}]}
    later = writer.delta("", 0, (), pieces[1])["choices"][0]["delta"]
    assert later == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}


def test_knobs_that_are_not_numbers_from_grpc_are_refused_by_name():
    for knob in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        with pytest.raises(InvalidArgument) as info:
            check_sampling(Sampling(**{knob: float("nan")}))
        assert info.value.param == knob

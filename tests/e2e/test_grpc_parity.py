"""A gRPC client gets what the official openai client gets, on the real model through the
real mesh: the same answers (greedy or seeded) with the same usage, text completions,
logprobs, JSON object/schema answers, n choices, request ids, cache-hit markers, sticky
traffic splits for a user, errors naming the field, and tool calls through an
OpenAI-compatible provider (llama-cpp-python's server with the real model)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import jsonschema
import openai
import pytest

from llmesh.testing import free_ports, port_open, terminate, wait_until, write_config_file
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import SMOL

SKY = "What color is the sky on a clear day?"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}}}
WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 20}}}
STOP, LENGTH, TOOL_CALLS = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH, \
    common_pb2.FINISH_REASON_TOOL_CALLS
FINISH = {STOP: "stop", LENGTH: "length", TOOL_CALLS: "tool_calls"}


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.layout.address("gateway")) as ch:
        yield gateway_pb2_grpc.GatewayStub(ch)


def user(text: str) -> list[common_pb2.ChatMessage]:
    return [common_pb2.ChatMessage(role="user", content=text)]


def chat(stub, model=SMOL, text=SKY, metadata=(), timeout=60, **fields):
    sampling = fields.pop("sampling", {})
    call = stub.Chat(gateway_pb2.ChatRequest(model=model, messages=fields.pop("messages", None) or user(text),
                                             sampling=common_pb2.SamplingParams(**sampling), **fields),
                     timeout=timeout, metadata=metadata)
    return list(call), call


def choice_texts(replies, n=1) -> list[str]:
    return ["".join(r.text for r in replies if r.index == i) for i in range(n)]


def finishes(replies) -> dict[int, gateway_pb2.ChatResponse]:
    return {r.index: r for r in replies if r.finish_reason}


def test_chat_gives_the_openai_clients_answer_and_usage(stub, client):
    sampling = {"temperature": 0.0, "max_tokens": 24, "stop": ["\n\n"]}
    replies, call = chat(stub, sampling=sampling, metadata=(("x-request-id", "parity-1"),))
    ref = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": SKY}], temperature=0,
                                         max_tokens=24, stop=["\n\n"])
    assert choice_texts(replies) == [ref.choices[0].message.content]
    assert replies[0].role == "assistant" and replies[0].model == SMOL
    last = finishes(replies)[0]
    assert FINISH[last.finish_reason] == ref.choices[0].finish_reason
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (ref.usage.prompt_tokens,
                                                                         ref.usage.completion_tokens)
    assert {r.id for r in replies} == {"chatcmpl-parity-1"}
    assert ("x-request-id", "parity-1") in call.trailing_metadata()


def test_text_completions_with_legacy_logprobs(stub, client):
    call = stub.Complete(gateway_pb2.CompleteRequest(
        model=SMOL, prompt="The capital of France is", sampling=common_pb2.SamplingParams(temperature=0, logprobs=2)),
        timeout=60)
    replies = list(call)
    ref = client.completions.create(model=SMOL, prompt="The capital of France is", temperature=0, logprobs=2)
    assert "".join(r.text for r in replies) == ref.choices[0].text
    tokens = [t for r in replies for t in r.logprobs]
    assert [t.token for t in tokens] == ref.choices[0].logprobs.tokens
    assert all(len(t.top) == 2 for t in tokens)
    last = [r for r in replies if r.finish_reason][0]
    assert last.usage.completion_tokens == ref.usage.completion_tokens == 16  # unset max_tokens: 16 on both
    assert replies[0].model == SMOL and replies[0].id.startswith("cmpl-")


def test_chat_logprobs_match(stub, client):
    replies, _ = chat(stub, sampling={"temperature": 0.0, "max_tokens": 6, "logprobs": 3})
    ref = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": SKY}], temperature=0,
                                         max_tokens=6, logprobs=True, top_logprobs=3)
    tokens = [t for r in replies for t in r.logprobs]
    assert [t.token for t in tokens] == [t.token for t in ref.choices[0].logprobs.content]
    for mine, theirs in zip(tokens, ref.choices[0].logprobs.content):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [a.token for a in mine.top] == [a.token for a in theirs.top_logprobs]


def test_json_schema_and_json_object(stub):
    fmt = common_pb2.ResponseFormat(type="json_schema", json_schema=json.dumps(PERSON))
    replies, _ = chat(stub, text="Invent a person.",
                      sampling={"temperature": 1.0, "seed": 3, "max_tokens": 64, "response_format": fmt})
    assert finishes(replies)[0].finish_reason == STOP
    jsonschema.validate(json.loads(choice_texts(replies)[0]), PERSON)
    replies, _ = chat(stub, text='Output this JSON exactly: {"color": "blue"}', timeout=120, sampling={
        "temperature": 0.0, "max_tokens": 12, "response_format": common_pb2.ResponseFormat(type="json_object")})
    assert choice_texts(replies)[0].startswith("{")  # JSON, never prose (12 tokens may cut it short)


def test_n_choices_are_the_openai_clients(stub, client):
    replies, _ = chat(stub, n=2, sampling={"temperature": 1.0, "seed": 5, "max_tokens": 6})
    ref = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": SKY}], temperature=1.0,
                                         seed=5, max_tokens=6, n=2)
    assert choice_texts(replies, 2) == [c.message.content for c in ref.choices]
    ends = finishes(replies)
    assert sorted(ends) == [0, 1]
    assert sum(e.usage.completion_tokens for e in ends.values()) == ref.usage.completion_tokens
    assert {r.index for r in replies if r.role == "assistant"} == {0, 1}  # each choice's first message


def test_a_cached_answer_is_marked(stub):
    sampling = {"temperature": 0.0, "max_tokens": 5}
    chat(stub, text="Name a fruit.", sampling=sampling)
    deadline = time.monotonic() + 5
    while True:  # the store happens after the answer
        replies, call = chat(stub, text="Name a fruit.", sampling=sampling)
        if ("x-llmesh-cache", "hit") in call.initial_metadata() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ("x-llmesh-cache", "hit") in call.initial_metadata()
    assert choice_texts(replies)[0]


@pytest.mark.parametrize("fields, body, grpc_param, http_param", [
    ({"sampling": {"temperature": 3.0}}, {"temperature": 3.0}, "sampling.temperature", "temperature"),
    ({"n": 17}, {"n": 17}, "n", "n"),
    ({"user": "u" * 257}, {"user": "u" * 257}, "user", "user"),
    ({"sampling": {"stop": list("abcde")}}, {"stop": list("abcde")}, "sampling.stop", "stop"),
    ({"messages": [common_pb2.ChatMessage(role="robot", content="x")]},
     {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "messages[0].role"),
    ({"sampling": {"top_k": -2}}, {"extra_body": {"top_k": -2}}, "sampling.top_k", "top_k"),
    ({"sampling": {"min_p": 1.5}}, {"extra_body": {"min_p": 1.5}}, "sampling.min_p", "min_p"),
    ({"sampling": {"repetition_penalty": 11.0}}, {"extra_body": {"repetition_penalty": 11}},
     "sampling.repetition_penalty", "repetition_penalty"),
    ({"sampling": {"presence_penalty": -3.0}}, {"presence_penalty": -3.0}, "sampling.presence_penalty",
     "presence_penalty"),
    ({"sampling": {"frequency_penalty": 2.5}}, {"frequency_penalty": 2.5}, "sampling.frequency_penalty",
     "frequency_penalty"),
])
def test_out_of_range_values_name_the_field_on_both_fronts(stub, client, fields, body, grpc_param, http_param):
    with pytest.raises(grpc.RpcError) as info:
        chat(stub, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(info.value.trailing_metadata())["llmesh-error-param"] == grpc_param
    body = {"messages": [{"role": "user", "content": "x"}], **body}
    with pytest.raises(openai.BadRequestError) as http_info:
        client.chat.completions.create(model=SMOL, max_tokens=2, **body)
    assert http_info.value.body["param"] == http_param


def test_both_fronts_list_the_same_models_with_what_each_serves(stub, client):
    resp = stub.ListModels(gateway_pb2.GatewayListModelsRequest(), timeout=5)
    http = client.models.list().data
    assert list(resp.models) == [m.id for m in http] and SMOL in resp.models
    apis = {gateway_pb2.MODEL_API_CHAT: "chat", gateway_pb2.MODEL_API_COMPLETIONS: "completions"}
    assert [(d.name, [apis[a] for a in d.serves], d.owned_by) for d in resp.details] == \
        [(m.id, m.model_extra["capabilities"], m.owned_by) for m in http]


def test_sampling_knobs_give_the_same_answer_on_both_fronts(stub, client):
    counting = "Continue: 1, 2, 3, 1, 2, 3, 1, 2, 3,"
    for knobs in ({"repetition_penalty": 10.0}, {"frequency_penalty": 2.0, "presence_penalty": 1.0},
                  {"top_k": 1, "min_p": 0.5}):
        sampling = {"temperature": 1.5 if "top_k" in knobs else 0.0, "seed": 4, "max_tokens": 16}
        replies, _ = chat(stub, text=counting, sampling={**sampling, **knobs})
        penalties = {k: v for k, v in knobs.items() if k.endswith("_penalty") and k != "repetition_penalty"}
        ref = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": counting}],
                                             **sampling, **penalties, extra_body={
                                                 k: v for k, v in knobs.items() if k not in penalties})
        assert choice_texts(replies) == [ref.choices[0].message.content], knobs
    greedy = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": counting}],
                                            temperature=0, max_tokens=16).choices[0].message.content
    assert ref.choices[0].message.content == greedy  # top_k 1: greedy at any temperature
    penalised = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": counting}],
                                               temperature=0, max_tokens=16, extra_body={"repetition_penalty": 10})
    assert penalised.choices[0].message.content != greedy


def test_a_backend_without_the_knobs_refuses_them_by_name_on_both_fronts(stub, client):
    with pytest.raises(grpc.RpcError) as info:
        chat(stub, model="sim-small", sampling={"max_tokens": 2, "top_k": 5})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_k" in info.value.details()
    with pytest.raises(openai.BadRequestError) as http_info:
        client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       frequency_penalty=0.5)
    assert http_info.value.body["param"] == "frequency_penalty"
    off = client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "x"}],
                                         max_tokens=2, presence_penalty=0, extra_body={"top_k": -1})
    assert off.usage.completion_tokens == 2  # off values pass


def test_a_user_stays_on_one_arm_of_a_split_on_both_fronts(stub, client, live_config):
    live_config(json.dumps({"default": {"max_attempts": 2}, "splits": {"ab": {"targets": [
        {"model": SMOL, "weight": 1}, {"model": "sim-small", "weight": 1}]}}}))
    assert "ab" in stub.ListModels(gateway_pb2.GatewayListModelsRequest(), timeout=5).models
    sampling = {"temperature": 0.0, "seed": 1, "max_tokens": 4}
    arms = set()
    for name in ("ann", "bob", "cat", "dan", "eve", "fay"):
        grpc_texts = {choice_texts(chat(stub, model="ab", user=name, sampling=sampling)[0])[0] for _ in range(3)}
        http = client.chat.completions.create(model="ab", messages=[{"role": "user", "content": SKY}], user=name,
                                              temperature=0, seed=1, max_tokens=4)
        assert grpc_texts == {http.choices[0].message.content}, name  # one arm per user, either front
        arms |= grpc_texts
    assert len(arms) == 2  # both arms serve somebody


# --- tools: an OpenAI-compatible provider serving the real model ---------------------------

REMOTE = "smol-remote"
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": WEATHER}}


@pytest.fixture(scope="module")
def tool_provider(mesh, config_file, real_model_dir, tmp_path_factory):
    """llama-cpp-python's OpenAI-compatible server with SmolLM2 as the provider of "smol-tools"."""
    gguf = next((real_model_dir / SMOL).glob("*.gguf"))
    port = free_ports(1)[0]
    log = (tmp_path_factory.mktemp("tools") / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias",
                             REMOTE, "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "1024",
                             "--n_threads", "1"], stdout=log, stderr=subprocess.STDOUT)
    before = config_file.read_text()
    try:
        assert wait_until(lambda: port_open(port), 60), "llama_cpp.server did not start"
        mesh.wait_for_config(write_config_file(config_file, json.dumps({
            "default": {"max_attempts": 2}, "providers": {"local": {
                "base_url": f"http://127.0.0.1:{port}/v1", "models": {"smol-tools": REMOTE}}}})))
        yield "smol-tools"
    finally:
        mesh.wait_for_config(write_config_file(config_file, before))
        terminate(proc, 15, 15.0)
        log.close()


def test_tool_calls_through_a_provider_on_both_fronts(stub, client, tool_provider):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    ref = client.chat.completions.create(model=tool_provider, messages=ask, tools=[TOOL], tool_choice=named,
                                         temperature=0, max_tokens=40)
    call = ref.choices[0].message.tool_calls[0]
    assert ref.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)

    streamed = list(client.chat.completions.create(model=tool_provider, messages=ask, tools=[TOOL],
                                                   tool_choice=named, temperature=0, max_tokens=40, stream=True))
    pieces = [tc for c in streamed if c.choices and c.choices[0].delta.tool_calls
              for tc in c.choices[0].delta.tool_calls]
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == args
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    replies, _ = chat(stub, model=tool_provider, text=ask[0]["content"],
                      sampling={"temperature": 0.0, "max_tokens": 40},
                      tools=[gateway_pb2.Tool(name="get_weather", description="The weather in a city",
                                              parameters=json.dumps(WEATHER))],
                      tool_choice=gateway_pb2.ToolChoice(mode="function", function="get_weather"))
    grpc_pieces = [tc for r in replies for tc in r.tool_calls]
    assert grpc_pieces[0].id and grpc_pieces[0].name == "get_weather"
    assert json.loads("".join(p.arguments for p in grpc_pieces)) == args
    assert finishes(replies)[0].finish_reason == TOOL_CALLS

    # The conversation goes on with the tool's result, on both fronts.
    turn = [*ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    follow = client.chat.completions.create(model=tool_provider, messages=turn, tools=[TOOL], tool_choice="none",
                                            temperature=0, max_tokens=12)
    pb_turn = [common_pb2.ChatMessage(role="user", content=ask[0]["content"]),
               common_pb2.ChatMessage(role="assistant", tool_calls=[common_pb2.ToolCall(
                   id=call.id, name="get_weather", arguments=call.function.arguments)]),
               common_pb2.ChatMessage(role="tool", tool_call_id=call.id, content="Sunny, 21 C")]
    replies, _ = chat(stub, model=tool_provider, messages=pb_turn, sampling={"temperature": 0.0, "max_tokens": 12},
                      tools=[gateway_pb2.Tool(name="get_weather", parameters=json.dumps(WEATHER))],
                      tool_choice=gateway_pb2.ToolChoice(mode="none"))
    assert choice_texts(replies) == [follow.choices[0].message.content]


def test_an_engine_that_cannot_call_tools_refuses_them_naming_them(stub, client):
    """The sim backend has no tool calling (tests/e2e/test_engine_tools.py has the llama.cpp engine's)."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}], tools=[TOOL])
    assert info.value.body["param"] == "tools" and "tools" in info.value.body["message"]
    with pytest.raises(grpc.RpcError) as rpc:
        chat(stub, model="sim-small", tools=[gateway_pb2.Tool(name="get_weather")])
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(rpc.value.trailing_metadata())["llmesh-error-param"] == "tools"

"""Tool calling on an llmesh engine: SmolLM2 on llama.cpp through the whole mesh, driven by the
official openai client and the gRPC front. A required or named call always parses and matches
its function's schema (streamed and not, both fronts, over generated schemas too); an agent loop
runs to completion (examples/python/agent.py too); tool_choice "none" gives text; a hostile
schema is a 400; a backend that cannot call tools (the sim) refuses them by name."""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import SMOL
from tests.e2e.tool_cases import (ASK, NAMED, SCHEMA, TIME, TOOLS, agent_loop, grpc_chat, required_call, run_example,
                                  valid)


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.layout.address("gateway")) as ch:
        yield gateway_pb2_grpc.GatewayStub(ch)


def test_named_and_required_calls_parse_and_match_streamed_and_not(client):
    named = client.chat.completions.create(model=SMOL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           parallel_tool_calls=False, temperature=0, max_tokens=80)
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content in (None, "")
    assert len(choice.message.tool_calls) == 1
    args = valid(choice.message.tool_calls[0], ("get_weather",))

    chunks = list(client.chat.completions.create(model=SMOL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                 parallel_tool_calls=False, temperature=0, max_tokens=80,
                                                 stream=True))
    pieces = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    first = pieces[0]
    assert first.id.startswith("call_") and first.function.name == "get_weather" and first.type == "function"
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == args  # greedy: the same call
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    # required with parallel calls (the default): one or more, each valid, each with its own id
    required = client.chat.completions.create(model=SMOL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              temperature=0.7, seed=3, max_tokens=200)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        valid(call)
    assert len({c.id for c in calls}) == len(calls)


def test_named_and_required_calls_on_the_grpc_front(stub):
    replies, calls = grpc_chat(stub, SMOL, TOOLS, gateway_pb2.ToolChoice(mode="function", function="get_time"),
                               temperature=0.0, max_tokens=80)
    assert len(calls) == 1 and calls[0][0].startswith("call_") and calls[0][1] == "get_time"
    jsonschema.validate(json.loads(calls[0][2]), TIME)
    assert [r.finish_reason for r in replies if r.finish_reason] == [common_pb2.FINISH_REASON_TOOL_CALLS]
    assert not "".join(r.text for r in replies)
    # required with parallel calls: one or more, each valid against its own function, each its own id
    replies, calls = grpc_chat(stub, SMOL, TOOLS, gateway_pb2.ToolChoice(mode="required"), parallel=True,
                               temperature=0.7, seed=3, max_tokens=200)
    assert calls and [r.finish_reason for r in replies if r.finish_reason] == [common_pb2.FINISH_REASON_TOOL_CALLS]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for _, name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])
    assert len({c[0] for c in calls}) == len(calls)


def test_an_agent_loop_runs_to_completion(client):
    """Call, the tool's result, answer: the loop an agent framework runs (tool_cases.agent_loop)."""
    resp, messages = agent_loop(client, SMOL)
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason in ("stop", "length") and message.content and not message.tool_calls
    assert any(m["role"] == "tool" for m in messages if isinstance(m, dict))


def test_stop_strings_end_text_but_never_cut_a_call(client):
    """Every call holds a newline: stop ["\n"] applies to a text answer only."""
    resp = client.chat.completions.create(model=SMOL, messages=ASK, tools=TOOLS, tool_choice=NAMED, stop=["\n"],
                                          parallel_tool_calls=False, temperature=0, max_tokens=80)
    assert resp.choices[0].finish_reason == "tool_calls"
    valid(resp.choices[0].message.tool_calls[0], ("get_weather",))
    text = client.chat.completions.create(model=SMOL, messages=ASK, tools=TOOLS, tool_choice="none", stop=[" "],
                                          temperature=0, max_tokens=12)
    assert text.choices[0].finish_reason == "stop" and " " not in text.choices[0].message.content


def test_tool_choice_none_gives_text(client):
    resp = client.chat.completions.create(model=SMOL, messages=ASK, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=12)
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_a_hostile_tool_schema_is_a_400_on_both_fronts(mesh, client, stub):
    hostile = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 100000}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": hostile}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SMOL, messages=ASK, tools=[tool], tool_choice="required", max_tokens=8)
    assert info.value.body["param"].startswith("tools[0].function.parameters")
    assert "maxLength" in info.value.body["message"]
    pb_tools = [gateway_pb2.Tool(name="f", parameters=json.dumps(hostile))]
    hi = [common_pb2.ChatMessage(role="user", content="hi")]
    with pytest.raises(grpc.RpcError) as rpc:
        list(stub.Chat(gateway_pb2.ChatRequest(model=SMOL, messages=hi, tools=pb_tools), timeout=60))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(mesh.layout.engine_address(0)) as ch:  # straight at the engine, too
        with pytest.raises(grpc.RpcError) as rpc:
            list(engine_pb2_grpc.EngineStub(ch).Generate(engine_pb2.GenerateRequest(
                model=SMOL, chat=engine_pb2.ChatInput(messages=hi), tools=pb_tools,
                tool_choice=gateway_pb2.ToolChoice(mode="required")), timeout=60))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(rpc.value.trailing_metadata())["llmesh-error-param"].startswith("tools[0].function.parameters")
    # the engine is still there
    assert client.chat.completions.create(model=SMOL, messages=ASK, max_tokens=2).choices[0].message.content


def test_a_backend_that_cannot_call_tools_refuses_them_by_name(client, stub):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="sim-small", messages=ASK, tools=TOOLS, max_tokens=2)
    assert info.value.body["param"] == "tools" and "cannot call tools" in info.value.body["message"]
    with pytest.raises(grpc.RpcError) as rpc:
        list(stub.Chat(gateway_pb2.ChatRequest(model="sim-small", messages=[common_pb2.ChatMessage(
            role="user", content="hi")], tools=[gateway_pb2.Tool(name="get_weather")]), timeout=60))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(rpc.value.trailing_metadata())["llmesh-error-param"] == "tools"


# --- generated schemas within the bounds ----------------------------------------------------



@settings(max_examples=4, deadline=None, derandomize=True, phases=[Phase.generate],  # a real model: no shrinking
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SCHEMA)
def test_a_required_call_always_matches_a_generated_schema(client, stub, schema):
    """On every front, HTTP streamed and not and gRPC, a required call parses and matches the schema."""
    for front in ("http", "http-stream", "grpc"):
        finish, names, arguments = required_call(client, stub, SMOL, schema, front)
        assert finish == ["tool_calls"] and names == ["act"], (front, schema, finish)
        jsonschema.validate(json.loads(arguments), schema)


def test_the_agent_example_runs(mesh):
    lines = run_example(mesh, "agent.py")
    assert lines[0].startswith("[get_weather({") and lines[-1].strip() and not lines[-1].startswith("[")

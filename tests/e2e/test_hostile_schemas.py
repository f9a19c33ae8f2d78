"""Hostile JSON schemas against the real mesh (llama.cpp engine with SmolLM2): over a bound
is 400 / INVALID_ARGUMENT naming the field and the limit on both fronts and straight at the
engine, a schema nested 100,000 levels deep too, and the engine process that a 36-byte schema
used to kill (SIGSEGV) is the same process afterwards, still answering."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest

from llmesh.rpc.status import PARAM_KEY
from llmesh.schema_bounds import LIMITS
from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import SMOL

CRASHER = '{"type":"string","maxLength":100000}'  # 36 bytes: SIGSEGV in llama.cpp's grammar parser before
MANY_ITEMS = '{"type":"array","items":{"type":"integer"},"minItems":10000000}'  # a 180 MB grammar before
PERSON = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "maxLength": 16}}}
SCHEMA = "response_format.json_schema.schema"
DEEP = '{"a":' * 100_000 + "1" + "}" * 100_000  # 100,000 levels
DEEP_64K = "[" * 32_000 + "]" * 32_000  # within 64 KiB, 32,000 levels
ASK = [{"role": "user", "content": "Answer in JSON."}]


def json_schema(schema: dict | str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema if isinstance(schema, dict)
                                                   else json.loads(schema)}}


def engine_process(mesh) -> dict:
    """The llama.cpp engine as `llmesh up` reports it (pid, restarts)."""
    state = json.loads((mesh.log_dir / "supervisor.json").read_text())
    address = mesh.layout.engine_address(0)
    return next(c for c in state["children"] if c["address"] == address)


def generate(address: str, schema: str, timeout: float = 60) -> list[engine_pb2.GenerateResponse]:
    request = engine_pb2.GenerateRequest(
        request_id="hostile", model=SMOL,
        chat=engine_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content="Answer in JSON.")]),
        sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0, response_format=common_pb2.ResponseFormat(
            type="json_schema", json_schema=schema)))
    with grpc.insecure_channel(address) as ch:
        return list(engine_pb2_grpc.EngineStub(ch).Generate(request, timeout=timeout))


def chat(address: str, schema: str, timeout: float = 60) -> list[gateway_pb2.ChatResponse]:
    request = gateway_pb2.ChatRequest(
        model=SMOL, messages=[common_pb2.ChatMessage(role="user", content="Answer in JSON.")],
        sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0, response_format=common_pb2.ResponseFormat(
            type="json_schema", json_schema=schema)))
    with grpc.insecure_channel(address) as ch:
        return list(gateway_pb2_grpc.GatewayStub(ch).Chat(request, timeout=timeout))


def refused(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value


@pytest.mark.parametrize("schema, field, limit", [(CRASHER, "maxLength", LIMITS.max_length),
                                                  (MANY_ITEMS, "minItems", LIMITS.max_items)])
def test_over_a_bound_is_400_naming_the_field_on_http(client, schema, field, limit):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SMOL, messages=ASK, max_tokens=8, response_format=json_schema(schema))
    assert info.value.status_code == 400
    assert info.value.body["param"] == f"{SCHEMA}.{field}"
    assert f"at most {limit}" in info.value.body["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": json.loads(schema)}}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SMOL, messages=ASK, max_tokens=8, tools=tools)
    assert info.value.body["param"] == f"tools[0].function.parameters.properties.x.{field}"


@pytest.mark.parametrize("schema, field", [(CRASHER, "maxLength"), (MANY_ITEMS, "minItems")])
def test_over_a_bound_is_invalid_argument_naming_the_field_on_grpc(mesh, schema, field):
    err = refused(chat, mesh.layout.address("gateway"), schema)
    assert dict(err.trailing_metadata())[PARAM_KEY] == f"{SCHEMA}.{field}"


def test_a_100000_deep_schema_is_400_and_invalid_argument_not_internal(mesh):
    body = ('{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], '
            '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}')
    for schema in (DEEP, '{"default": %s}' % DEEP_64K):
        r = httpx.post(mesh.layout.http_url + "/v1/chat/completions", content=body % (SMOL, schema),
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert "bytes" in refused(chat, mesh.layout.address("gateway"), DEEP).details()
    err = refused(chat, mesh.layout.address("gateway"), '{"default": %s}' % DEEP_64K)
    assert "nested 32001 levels deep" in err.details() and "Traceback" not in err.details()
    err = refused(generate, mesh.layout.engine_address(0), '{"default": %s}' % DEEP_64K)
    assert dict(err.trailing_metadata())[PARAM_KEY] == SCHEMA


def test_the_engine_refuses_the_crashers_itself_and_serves_on(mesh, client):
    """Straight at the engine (past the gateway's checks): INVALID_ARGUMENT, and the same
    engine process then answers a schema it can serve, through the gateway too."""
    before = engine_process(mesh)
    for schema, field in ((CRASHER, "maxLength"), (MANY_ITEMS, "minItems")):
        for _ in range(2):
            err = refused(generate, mesh.layout.engine_address(0), schema)
            assert dict(err.trailing_metadata())[PARAM_KEY] == f"{SCHEMA}.{field}"
    answer = generate(mesh.layout.engine_address(0), json.dumps(PERSON))
    assert "".join(r.text for r in answer).startswith("{")
    resp = client.chat.completions.create(model=SMOL, messages=ASK, max_tokens=24, temperature=0,
                                          response_format=json_schema(PERSON))
    assert resp.choices[0].message.content.startswith("{")
    after = engine_process(mesh)
    assert after["pid"] == before["pid"] and after["alive"] and after["restarts"] == before["restarts"]

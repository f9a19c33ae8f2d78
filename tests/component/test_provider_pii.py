"""PII in tool-call arguments, tools' answers and tool definitions is masked before the request
leaves for an external provider, and what the provider gets is still valid JSON: the gateway's
pipeline (validation, the guards stage, routing) in process, its provider client, and a fake
provider (``helpers.RecordingProvider``, an HTTP server on loopback standing in for an external
OpenAI-compatible API) that keeps the raw body of every call. The guards' work runs inline for
a small request and in a guard worker process for a large one; both mask the same."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from llmesh.liveconfig.schema import MeshConfig, Provider
from llmesh.types import Message, Prompt, Tool, ToolCall, Tools
from llmesh.gateway.domain.guards.pii import PiiMasker
from llmesh.gateway.guard_workers import GuardWorkers
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.stages.guards import GuardStage
from llmesh.gateway.stages.route import RouteStage
from llmesh.gateway.stages.validate import ValidateStage
from llmesh.gateway.upstream.engines import EngineClients
from llmesh.gateway.upstream.picking import EndpointPicker
from llmesh.gateway.upstream.providers import ProviderClients
from tests.component.helpers import Catalog, collect, completion_request, recording_provider

SECRETS = ("dave@example.com", "dave\\u0040example.com", "4111111111111111", "4111 1111 1111 1111", "13800138000",
           "carol@example.com", "ops@example.com", "alice@corp.example.com", "+1 415 555 2671")

SCHEMA = {"type": "object", "required": ["to"], "additionalProperties": False,
          "properties": {"to": {"type": "string", "description": "the address, e.g. alice@corp.example.com",
                                "enum": ["ops@example.com", "dave@example.com"]},
                         "card": {"type": "integer", "examples": [4111111111111111]}}}


def conversation(padding: int) -> tuple[Prompt, Tools]:
    args = json.dumps({"to": "dave@example.com", "card": 4111111111111111, "cc": ["+1 415 555 2671"]})
    prompt = Prompt(messages=(
        Message("system", "You send mail." + " Be brief." * padding),
        Message("user", "Send my card number to the usual address"),
        Message("assistant", "", tool_calls=(ToolCall(0, "call_1", "send_mail", args),)),
        Message("tool", '{"delivered": true, "to": "dave\\u0040example.com", "phone": 13800138000, '
                        '"card": "4111 1111 1111 1111"}', tool_call_id="call_1")))
    tools = Tools(functions=(Tool("send_mail", "Sends mail from carol@example.com", json.dumps(SCHEMA)),),
                  choice="auto")
    return prompt, tools


@pytest.mark.parametrize("padding", [0, 2000], ids=["inline", "guard-worker"])
async def test_tool_arguments_and_definitions_reach_the_provider_masked_and_valid(padding):
    workers = GuardWorkers(1, deadline_s=30) if padding else None
    async with recording_provider() as (fake, base_url):
        config = MeshConfig(providers={"remote": Provider(base_url=base_url, models={"hosted": "their-model"})})
        providers = ProviderClients(proxies={})
        pipeline = Pipeline(EndpointPicker(), EngineClients(), Catalog(prefix=""), config=lambda: config,
                            providers=providers,
                            stages=[ValidateStage(), GuardStage(lambda: config, PiiMasker(),
                                                                offload=workers.run if workers else None),
                                    RouteStage(Catalog(prefix=""), lambda: config)])
        prompt, tools = conversation(padding)
        try:
            answer = await collect(pipeline, replace(completion_request("hosted", prompt=prompt, timeout_s=30),
                                                     tools=tools))
        finally:
            await providers.close()
            if workers:
                workers.close()
    assert answer.text == "ok"
    [raw] = fake.bodies
    assert not [s for s in SECRETS if s.encode() in raw]
    body = json.loads(raw)
    assert body["model"] == "their-model"
    call = body["messages"][2]["tool_calls"][0]
    assert (call["id"], call["function"]["name"]) == ("call_1", "send_mail")
    args = json.loads(call["function"]["arguments"])  # still JSON
    assert set(args) == {"to", "card", "cc"} and args["to"].startswith("[EMAIL_") and args["card"] == "[CARD_1]"
    assert args["cc"][0].startswith("[PHONE_")
    answered = json.loads(body["messages"][3]["content"])
    assert body["messages"][3]["tool_call_id"] == "call_1"
    assert answered["to"] == args["to"] and answered["card"] == "[CARD_1]" and answered["delivered"] is True
    fn = body["tools"][0]["function"]
    assert fn["name"] == "send_mail" and fn["description"].startswith("Sends mail from [EMAIL_")
    schema = fn["parameters"]  # still a schema: names, types and the required list as they were
    assert schema["required"] == ["to"] and set(schema["properties"]) == {"to", "card"}
    assert schema["properties"]["to"]["type"] == "string" and schema["properties"]["card"]["type"] == "integer"
    assert schema["properties"]["to"]["enum"][1] == args["to"]  # one value, one placeholder, request-wide
    assert schema["properties"]["card"]["examples"] == ["[CARD_1]"]

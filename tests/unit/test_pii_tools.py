"""PII masking over tools: the arguments of the calls an assistant made, a tool's answer, and the
offered tools' descriptions and parameter schemas. They are JSON and stay JSON: values are
masked one by one (escapes decoded first, a number that is PII becomes its placeholder as a
string), names, types and patterns of a schema are kept, and what holds no PII keeps its bytes."""

from __future__ import annotations

import json

import pytest

from llmesh.types import Message, Prompt, Tool, ToolCall, Tools
from llmesh.gateway.domain.guards import screening
from llmesh.gateway.domain.guards.pii import PiiMasker
from llmesh.gateway.domain.guards.pii_json import mask_json_text, mask_schema_text

PII = ("dave@example.com", "4111111111111111", "13800138000", "MIIEvQIBADANBg", "carol@example.com",
       "bob@example.com", "alice@corp.example.com", "ops@example.com")


@pytest.fixture(scope="module")
def masker() -> PiiMasker:
    return PiiMasker()


def run(masker: PiiMasker, messages: tuple[Message, ...], tools: Tools | None = None) -> screening.GuardResult:
    kinds = tuple(sorted(k.value for k in masker.kinds))
    return screening.run(screening.GuardJob(Prompt(messages=messages), None, kinds, tools=tools), None, masker)


SCHEMA = {"type": "object", "required": ["email", "description"], "additionalProperties": False,
          "properties": {
              "email": {"type": "string", "format": "email", "description": "like bob@example.com",
                        "examples": ["alice@corp.example.com", {"to": "alice@corp.example.com"}],
                        "enum": ["ops@example.com", "nobody"], "default": "ops@example.com"},
              "description": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}-[0-9]{4}$", "title": "Free text"},
              "card": {"type": "integer", "const": 4111111111111111}},
          "$defs": {"example": {"type": "string", "description": "from carol@example.com"}}}


def test_tool_calls_answers_and_definitions_are_masked_and_stay_json(masker):
    args = json.dumps({"email": "dave@example.com", "card": 4111111111111111, "nested": [{"who": "dave@example.com"}],
                       "key": "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBg"})  # no END line: still JSON after
    messages = (
        Message("user", "Mail dave@example.com please"),
        Message("assistant", "", tool_calls=(ToolCall(0, "call_1", "send", args),)),
        Message("tool", '{"sent": true, "to": "dave\\u0040example.com", "phone": 13800138000}', tool_call_id="call_1"),
        Message("tool", "delivered to dave@example.com", tool_call_id="call_1"))
    tools = Tools(functions=(Tool("send", "Send as carol@example.com", json.dumps(SCHEMA), True),), choice="auto")
    result = run(masker, messages, tools)
    assert result.prompt is not None and result.tools is not None
    sent = json.dumps([[m.content for m in result.prompt.messages],
                       [c.arguments for m in result.prompt.messages for c in m.tool_calls],
                       [(f.description, f.parameters) for f in result.tools.functions]])
    assert not [value for value in PII if value in sent]
    call = result.prompt.messages[1].tool_calls[0]
    assert (call.id, call.name) == ("call_1", "send")
    assert json.loads(call.arguments) == {"email": "[EMAIL_1]", "card": "[CARD_1]", "nested": [{"who": "[EMAIL_1]"}],
                                          "key": "[SECRET_1]"}
    assert json.loads(result.prompt.messages[2].content) == {"sent": True, "to": "[EMAIL_1]", "phone": "[PHONE_1]"}
    assert result.prompt.messages[2].tool_call_id == "call_1"
    assert result.prompt.messages[3].content == "delivered to [EMAIL_1]"  # not JSON: masked as text
    fn = result.tools.functions[0]
    ph = {original: placeholder for placeholder, original in result.found.items()}  # one per value, request-wide
    assert (fn.name, fn.strict, fn.description) == ("send", True, f"Send as {ph['carol@example.com']}")
    schema = json.loads(fn.parameters)
    email = schema["properties"]["email"]
    assert email["description"] == f"like {ph['bob@example.com']}"
    assert email["enum"] == [ph["ops@example.com"], "nobody"] and email["default"] == ph["ops@example.com"]
    assert email["examples"] == [ph["alice@corp.example.com"], {"to": ph["alice@corp.example.com"]}]
    assert schema["properties"]["card"]["const"] == "[CARD_1]"
    # names, types, formats and patterns are the author's, even a property called "description"
    assert schema["required"] == SCHEMA["required"] and set(schema["properties"]) == set(SCHEMA["properties"])
    assert schema["properties"]["description"] == SCHEMA["properties"]["description"]
    assert email["type"] == "string" and email["format"] == "email"
    assert schema["$defs"]["example"]["description"] == "from [EMAIL_2]"  # the same value, the same placeholder
    assert result.counts["email"] == 12 and result.found["[EMAIL_1]"] == "dave@example.com"


def test_what_holds_no_pii_is_passed_on_as_it_was(masker):
    args = '{ "city" : "Paris",  "days": 3 }'
    messages = (Message("user", "Weather?"), Message("assistant", "", tool_calls=(ToolCall(0, "c", "w", args),)),
                Message("tool", '{"temp": 21, "at": "2024-01-02T10:00:00Z"}', tool_call_id="c"))
    schema = '{"type": "object", "properties": {"city": {"type": "string"}}}'
    tools = Tools(functions=(Tool("w", "The weather", schema),))
    result = run(masker, messages, tools)
    assert result.prompt is None and result.tools is None and not result.counts
    chat = masker.mask_messages(messages)
    assert all(a is b for a, b in zip(chat.messages, messages))


def test_big_integers_stay_exact_and_odd_json_is_masked_as_text(masker):
    def mask(text: str) -> str:
        return masker.mask(text).text

    assert json.loads(mask_json_text('{"id": 123456789012345678901234567890, "to": "a@example.com"}', mask)) == \
        {"id": 123456789012345678901234567890, "to": "[EMAIL_1]"}
    assert mask_json_text('{"to": "a@example.com"', mask) is None  # not JSON: the caller masks it as text
    assert mask_json_text("a@example.com", mask) is None
    deep = "[" * 100_000 + '"a@example.com"' + "]" * 100_000  # deeper than the parser goes: no crash
    assert mask_json_text(deep, mask) is None and mask_schema_text(deep, mask) is None
    chat = masker.mask_messages((Message("assistant", "", tool_calls=(ToolCall(0, "c", "f", deep),)),))
    assert "a@example.com" not in chat.messages[0].tool_calls[0].arguments


def test_placeholder_text_already_in_tools_is_never_handed_out(masker):
    """A placeholder-shaped value in an argument is the user's text: restoring never rewrites it."""
    messages = (Message("user", "x@example.com"),
                Message("assistant", "", tool_calls=(ToolCall(0, "c", "f", '{"note": "[EMAIL_1]"}'),)))
    tools = Tools(functions=(Tool("f", "see [EMAIL_2]", '{"type": "object", "description": "y@example.com"}'),))
    result = run(masker, messages, tools)
    assert result.prompt is not None and result.tools is not None
    assert result.prompt.messages[0].content == "[EMAIL_3]"
    assert json.loads(result.tools.functions[0].parameters)["description"] == "[EMAIL_4]"
    assert json.loads(result.prompt.messages[1].tool_calls[0].arguments) == {"note": "[EMAIL_1]"}


def test_the_guard_work_counts_tool_text_when_judging_its_cost():
    def job(prompt: Prompt, tools: Tools | None = None) -> screening.GuardJob:
        return screening.GuardJob(prompt, None, ("email",), tools=tools)

    small = Prompt(messages=(Message("user", "hi"),))
    big = Tools(functions=(Tool("f", "x" * (screening.INLINE_CHARS + 1)),))
    assert screening.light(job(small)) and not screening.light(job(small, big))
    calls = Prompt(messages=(Message("assistant", "", tool_calls=(ToolCall(0, "c", "f", "7" * 9000),)),))
    assert not screening.light(job(calls)) and screening.worst_seconds(job(calls)) > screening.worst_seconds(job(small))

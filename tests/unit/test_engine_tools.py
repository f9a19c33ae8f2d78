"""Tool calling on llmesh engines, the pure parts: the chat as the model reads it with tools
(llmesh.tool_prompt), calls read out of the answer (CallReader), and the grammar an answer is
held to (tools_grammar), hostile schemas included."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmesh.errors import Internal, InvalidArgument
from llmesh.tool_prompt import call_text, offered, render
from llmesh.types import Delta, FinishReason, Message, Prompt, Tool, ToolCall, Tools
from llmesh.engine.backends.llamacpp_grammar import MAX_PARALLEL_CALLS, tools_grammar
from llmesh.engine.toolcalls import CallReader

WEATHER = json.dumps({"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}})
TOOLS = Tools(functions=(Tool("get_weather", "The weather", WEATHER), Tool("get_time")), choice="auto")


def test_the_offered_tools_join_the_system_message_and_the_history_is_rendered():
    chat = Prompt(messages=(Message("system", "Be brief."), Message("user", "Weather in Paris?"),
                            Message("assistant", "", (ToolCall(0, "call_1", "get_weather", '{"city":"Paris"}'),)),
                            Message("tool", "sunny", tool_call_id="call_1")))
    shown = render(chat, TOOLS).messages
    assert [m.role for m in shown] == ["system", "user", "assistant", "user"]
    assert shown[0].content.startswith("Be brief.\n\n") and '"name": "get_weather"' in shown[0].content
    assert json.loads(shown[0].content.split("<tools>\n")[1].split("\n")[1]) == {
        "type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    assert shown[2].content == '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
    assert shown[3].content == "<tool_response>\nsunny\n</tool_response>"
    assert all(not m.tool_calls for m in shown)
    # none offers nothing, but the history is still rendered; a plain chat is left as it is
    none = render(chat, Tools(TOOLS.functions, choice="none")).messages
    assert none[0] == chat.messages[0] and none[2].content == shown[2].content
    plain = Prompt(messages=(Message("user", "hi"),))
    assert render(plain, None) is plain
    assert render(plain, TOOLS).messages[0].role == "system"
    assert offered(Tools(choice="required")) is None and offered(TOOLS) is TOOLS


def feed_all(reader: CallReader, pieces: list[str]) -> list[Delta]:
    return [out for p in pieces if (out := reader.feed(Delta(p, 1))) is not None]


CALLS = call_text("get_weather", '{"city": "Paris" }') + "\n" + call_text("get_time", "{}")


@settings(max_examples=60)
@given(cuts=st.lists(st.integers(0, len(CALLS)), max_size=12))
def test_calls_come_out_whole_however_the_text_is_split(cuts):
    bounds = sorted({0, len(CALLS), *cuts})
    reader = CallReader(calls_only=True)
    out = feed_all(reader, [CALLS[a:b] for a, b in zip(bounds, bounds[1:])])
    calls = [c for d in out for c in d.tool_calls]
    assert [(c.index, c.name, c.arguments) for c in calls] == [(0, "get_weather", '{"city":"Paris"}'),
                                                               (1, "get_time", "{}")]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls) and calls[0].id != calls[1].id
    assert not "".join(d.text for d in out) and sum(d.tokens for d in out) == len(bounds) - 1
    assert reader.reason(FinishReason.STOP) is FinishReason.TOOL_CALLS
    assert reader.reason(FinishReason.LENGTH) is FinishReason.LENGTH


def test_auto_passes_text_through_and_reads_a_call():
    reader = CallReader(calls_only=False)
    out = feed_all(reader, ["", "Hello", " there"])
    assert [d.text for d in out] == ["Hello", " there"] and reader.reason(FinishReason.STOP) is FinishReason.STOP
    reader = CallReader(calls_only=False)
    out = feed_all(reader, ["<", "tool_call>\n", call_text("f", '{"a": 1}')[len("<tool_call>\n"):]])
    assert [c.name for d in out for c in d.tool_calls] == ["f"]
    cut = CallReader(calls_only=True)  # cut by max_tokens: no call, finish stays length
    assert not feed_all(cut, [CALLS[:30]]) and cut.reason(FinishReason.LENGTH) is FinishReason.LENGTH
    with pytest.raises(Internal):
        feed_all(CallReader(calls_only=True), ["<tool_call>\nnot json\n</tool_call>"])


def test_the_grammar_holds_the_answer_to_the_offered_calls():
    auto = tools_grammar(TOOLS)
    assert 'root ::= tool-call ("\\n" tool-call){0,' + str(MAX_PARALLEL_CALLS - 1) + "} | text" in auto
    assert '"\\"get_weather\\", \\"arguments\\": " tool0-arguments' in auto and "tool1-arguments" in auto
    named = tools_grammar(Tools(TOOLS.functions, choice="function", function="get_time", parallel=False))
    assert "root ::= tool-call\n" in named and "get_weather" not in named and "text ::=" not in named


def test_each_tools_refs_resolve_within_its_own_schema():
    def with_ref(kind: str) -> str:
        return json.dumps({"type": "object", "required": ["x"], "properties": {"x": {"$ref": "#/$defs/v"}},
                           "$defs": {"v": {"type": kind}}})
    grammar = tools_grammar(Tools((Tool("a", "", with_ref("integer")), Tool("b", "", with_ref("boolean"))),
                                  choice="required"))
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    assert (rules["tool0-arguments-x"], rules["tool1-arguments-x"]) == ("integer", "boolean"), grammar


def test_hostile_tool_schemas_are_refused_naming_the_tool():
    from bench.hostile_schemas import cases
    from llmesh.schema_bounds import LIMITS

    refused = 0
    for _, name, body in cases(LIMITS.max_bytes + 1, "m"):
        if "tools" not in body:
            continue
        tools = Tools((Tool("ok", "", '{"type":"object"}'),
                       Tool("f", "", json.dumps(body["tools"][0]["function"]["parameters"]))), choice="required")
        try:
            grammar = tools_grammar(tools)
        except InvalidArgument as exc:
            assert exc.param.startswith(("tools[1].function.parameters", "tools")), (name, exc.param)
            refused += 1
            continue
        assert len(grammar) <= LIMITS.max_grammar_bytes, name
    assert refused > 20


def test_stop_strings_end_a_text_answer_but_never_cut_a_call():
    text = CallReader(calls_only=False, stops=("\n",))
    out = feed_all(text, ["Sunny", " today\nand", " more"])
    assert "".join(d.text for d in out) == "Sunny today" and text.stopped and text.flush() is None
    held = CallReader(calls_only=False, stops=("END",))
    assert "".join(d.text for d in feed_all(held, ["Hi E"])) == "Hi " and not held.stopped
    assert held.flush() == Delta("E", 0)  # a stop string that did not come: its start is text after all
    calls = CallReader(calls_only=False, stops=("\n", "</tool_call>"))
    out = feed_all(calls, [CALLS])
    assert [c.name for d in out for c in d.tool_calls] == ["get_weather", "get_time"] and not calls.stopped

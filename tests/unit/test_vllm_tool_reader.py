"""The vllm backend's tool-call reader (vllm_tools.HermesCallReader) over a stand-in for vLLM's hermes
parser that reads blocks as it does (``<tool_call>`` JSON ``</tool_call>``): where text ends and calls
begin, stop strings, the call bound, a cut call, a block that does not parse; and tools vLLM refuses.
The real parser and structural tag run on vLLM's engine in tests/component/test_vllm_tools.py."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from llmesh.errors import Internal, InvalidArgument
from llmesh.tool_prompt import MAX_PARALLEL_CALLS, call_text
from llmesh.types import Delta, FinishReason, Tool, Tools
from llmesh.engine.backends.vllm_tools import HermesCallReader, VllmToolApi, VllmToolCalls


def parse(block: str) -> SimpleNamespace:
    """What vLLM's Hermes2ProToolParser.extract_tool_calls returns for one block."""
    try:
        calls = [json.loads(body) for body in re.findall(r"<tool_call>(.*?)</tool_call>", block, re.DOTALL)]
        found = [SimpleNamespace(function=SimpleNamespace(name=c["name"], arguments=json.dumps(c["arguments"])))
                 for c in calls]
    except (ValueError, KeyError):
        return SimpleNamespace(tools_called=False, tool_calls=[], content=block)
    return SimpleNamespace(tools_called=bool(found), tool_calls=found, content=None)


def overlap(text: str, tag: str) -> int:
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def read(pieces: list[str], stops: tuple[str, ...] = ()) -> tuple[HermesCallReader, list[Delta]]:
    reader = HermesCallReader(parse, overlap, stops)
    out = [d for d in (reader.feed(Delta(p, 1)) for p in pieces) if d is not None]
    if (rest := reader.flush()) is not None:
        out.append(rest)
    return reader, out


def test_text_then_calls_split_where_the_tag_starts():
    call = call_text("get_time", '{"zone": "UTC"}')
    reader, out = read(["Let me ", "check <tool", "_call>", call.removeprefix("<tool_call>"),
                        call[:20], call[20:]])
    assert "".join(d.text for d in out) == "Let me check "
    calls = [c for d in out for c in d.tool_calls]
    assert [(c.index, c.name, c.arguments) for c in calls] == [(0, "get_time", '{"zone":"UTC"}'),
                                                               (1, "get_time", '{"zone":"UTC"}')]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert sum(d.tokens for d in out) == 6 and all(d.tokens for d in out)  # every token counted, no empty Delta
    assert reader.reason(FinishReason.STOP) is FinishReason.TOOL_CALLS


def test_text_and_a_whole_call_in_one_delta_come_out_together():
    reader, out = read(["Sure. " + call_text("f", "{}")])
    assert [(d.text, d.tokens, [c.name for c in d.tool_calls]) for d in out] == [("Sure. ", 1, ["f"])]


def test_a_stop_string_ends_the_text_and_never_cuts_a_call():
    reader, out = read(["Hello\nworld ", call_text("f", '{"a": "x\\ny"}')], stops=("\n",))
    assert "".join(d.text for d in out) == "Hello" and reader.stopped and not reader.calls
    reader, out = read([call_text("f", '{"a": "x\\ny"}')], stops=("\n",))
    assert [json.loads(c.arguments) for d in out for c in d.tool_calls] == [{"a": "x\ny"}]


def test_calls_end_at_the_bound_and_a_cut_call_is_dropped():
    reader, out = read([call_text("f", "{}")] * (MAX_PARALLEL_CALLS + 2))
    assert reader.calls == MAX_PARALLEL_CALLS and reader.stopped
    reader, out = read([call_text("f", "{}"), call_text("g", '{"a": 1}')[:-5]])
    assert [c.name for d in out for c in d.tool_calls] == ["f"]
    assert reader.reason(FinishReason.LENGTH) is FinishReason.LENGTH


def test_what_might_have_begun_a_tag_is_text_at_the_end_or_the_next_call_when_it_is_one():
    reader, out = read(["a <", "b <tool"])
    assert "".join(d.text for d in out) == "a <b <tool" and not reader.calls
    reader, out = read(["a <tool"], stops=("ol",))
    assert "".join(d.text for d in out) == "a <to" and reader.stopped
    call = call_text("f", "{}")
    reader, out = read([call + "\n<tool", "_call>" + call.removeprefix("<tool_call>")])
    assert [c.index for d in out for c in d.tool_calls] == [0, 1]


def test_a_block_the_parser_cannot_read_fails_the_request():
    with pytest.raises(Internal, match="does not parse"):
        read(["<tool_call>\n{\"name\": \"f\", \"arguments\": {oops}\n</tool_call>"])


def test_tools_vllm_refuses_are_invalid_argument_and_a_request_is_made_once_per_tools():
    made = []

    def request(**fields):
        made.append(fields)
        if fields["tools"][0]["function"]["name"] == "bad":
            raise ValueError("1 validation error for ChatCompletionRequest")
        return SimpleNamespace(**fields)

    tag = SimpleNamespace(model_dump=lambda: {"type": "structural_tag"})
    parser = SimpleNamespace(get_structural_tag=lambda request, **kw: tag, extract_tool_calls=lambda t, r: parse(t))
    calls = VllmToolCalls(VllmToolApi(parser, request, "parameter", lambda t: None, overlap), "m")
    with pytest.raises(InvalidArgument, match="vLLM refused the tools") as info:
        calls.structural_tag(Tools((Tool("bad"),), "required"))
    assert info.value.param == "tools"
    tools = Tools((Tool("f", "", '{"properties": {"a": {"type": "integer"}}}'),), "function", "f", parallel=False)
    assert calls.structural_tag(tools) == '{"type": "structural_tag"}'
    calls.reader(tools)
    assert len(made) == 2 and made[1]["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert made[1]["tools"][0]["function"]["parameters"]["type"] == "object"  # arguments are an object

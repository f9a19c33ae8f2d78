"""Tool calls on vLLM's real engine through the engine core (the session's ``real_vllm``: AsyncLLM
from vLLM's CPU build serving SmolLM2 in fp32): vLLM's hermes structural tag constrains a required
or named call, vLLM's hermes parser reads it, and it matches its function's schema (over generated
schemas too); auto gives text or valid calls; "none" offers nothing; a schema the bounds refuse, or
one vLLM's grammar backend cannot compile, is INVALID_ARGUMENT and the engine serves on; a chat
template that takes tools renders them. Run with .venv-vllm's interpreter (`make test` does)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from llmesh.errors import InvalidArgument
from llmesh.types import Finish, FinishReason, Message, Prompt, Sampling, Tool, ToolCall, Tools
from llmesh.engine.admission import Admission
from llmesh.engine.backends.vllm import VllmBackend
from llmesh.engine.core import EngineCore
from tests.component.helpers import answered
from tests.e2e.tool_cases import ASK, SCHEMA, SCHEMAS, TOOLS

MODEL = "smollm2-vllm"  # the real_vllm fixture's served name
OFFERED = tuple(Tool(t["function"]["name"], t["function"]["description"], json.dumps(t["function"]["parameters"]))
                for t in TOOLS)
CHAT = Prompt(messages=tuple(Message(m["role"], m["content"]) for m in ASK))


@pytest.fixture
def core(real_vllm) -> EngineCore:
    return EngineCore(real_vllm, Admission(max_running=8, max_waiting=8))


async def answer(core: EngineCore, tools: Tools, sampling: Sampling, prompt: Prompt = CHAT
                 ) -> tuple[str, list[ToolCall], Finish]:
    deltas, finish = await answered(core, MODEL, prompt, sampling, tools=tools)
    assert finish is not None
    return "".join(d.text for d in deltas), [c for d in deltas for c in d.tool_calls], finish


def valid(call: ToolCall, schemas: dict = SCHEMAS) -> dict:
    assert call.id.startswith("call_") and call.name in schemas
    args = json.loads(call.arguments)
    jsonschema.validate(args, schemas[call.name])
    return args


async def test_named_and_required_calls_parse_and_match_their_schema(core):
    text, calls, finish = await answer(core, Tools(OFFERED, "function", "get_time", parallel=False),
                                       Sampling(temperature=0.0, max_tokens=80))
    assert finish.reason is FinishReason.TOOL_CALLS and not text
    assert [c.name for c in calls] == ["get_time"] and calls[0].index == 0
    valid(calls[0])
    text, calls, finish = await answer(core, Tools(OFFERED, "required"), Sampling(temperature=0.7, seed=3,
                                                                                  max_tokens=200))
    assert finish.reason is FinishReason.TOOL_CALLS and not text and 1 <= len(calls) <= 8
    assert [c.index for c in calls] == list(range(len(calls))) and len({c.id for c in calls}) == len(calls)
    for call in calls:
        valid(call)


async def test_auto_answers_in_text_or_valid_calls_and_none_offers_nothing(core, real_vllm):
    for seed in (1, 2):
        text, calls, finish = await answer(core, Tools(OFFERED, "auto"), Sampling(temperature=0.9, seed=seed,
                                                                                  max_tokens=60))
        assert calls or text
        assert (finish.reason is FinishReason.TOOL_CALLS) == bool(calls)
        for call in calls:
            valid(call)
    none = Tools(OFFERED, "none")
    assert real_vllm.tokenize_chat(CHAT, none) == real_vllm.tokenize(CHAT)  # nothing shown
    text, calls, finish = await answer(core, none, Sampling(temperature=0.0, max_tokens=12))
    assert text and not calls and finish.reason in (FinishReason.STOP, FinishReason.LENGTH)


async def test_an_agent_loop_on_the_engine(core):
    """Call, the tool's result in the history (Hermes-rendered: SmolLM2's template has no tools), answer."""
    tools = Tools(OFFERED, "function", "get_weather", parallel=False)
    _, calls, _ = await answer(core, tools, Sampling(temperature=0.0, max_tokens=80))
    history = Prompt(messages=(*CHAT.messages, Message("assistant", "", tuple(calls)),
                               Message("tool", '{"weather": "sunny, 21 C"}', tool_call_id=calls[0].id)))
    text, again, finish = await answer(core, Tools(OFFERED, "none"), Sampling(temperature=0.0, max_tokens=30),
                                       history)
    assert text and not again and finish.reason in (FinishReason.STOP, FinishReason.LENGTH)


@settings(max_examples=3, deadline=None, derandomize=True, phases=[Phase.generate],  # a real model: no shrinking
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SCHEMA)
async def test_a_required_call_always_matches_a_generated_schema(core, schema):
    tools = Tools((Tool("act", "Do it", json.dumps(schema)),), "required", parallel=False)
    prompt = Prompt(messages=(Message("user", "Call the tool."),))
    _, calls, finish = await answer(core, tools, Sampling(temperature=0.8, seed=1, max_tokens=400), prompt)
    assert finish.reason is FinishReason.TOOL_CALLS and [c.name for c in calls] == ["act"], (schema, finish)
    valid(calls[0], {"act": schema})


async def test_hostile_schemas_are_invalid_argument_and_the_engine_serves_on(core):
    hostile = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 100000}}}
    with pytest.raises(InvalidArgument) as info:
        await answer(core, Tools((Tool("f", "", json.dumps(hostile)),), "required"), Sampling(max_tokens=8))
    assert info.value.param.startswith("tools[0].function.parameters") and "maxLength" in info.value.message
    # within the bounds, but a pattern vLLM's grammar backend cannot compile (a lookbehind)
    lookbehind = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}, "required": ["a"]}
    with pytest.raises(InvalidArgument, match="vLLM refused"):
        await answer(core, Tools((Tool("f", "", json.dumps(lookbehind)),), "required"), Sampling(max_tokens=8))
    _, calls, _ = await answer(core, Tools(OFFERED, "function", "get_time"), Sampling(temperature=0.0, max_tokens=80))
    valid(calls[0])


def test_a_chat_template_that_takes_tools_renders_them(real_vllm):
    """A template with ``tools`` (as Qwen2.5's and Hermes' have) shows the tools and the history's calls
    itself; SmolLM2's has none, so tool_prompt's Hermes rendering does (tokenize_chat)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_vllm._engine.vllm_config.model_config.model)
    tokenizer.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }} {{ t.function.parameters | tojson }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
        "CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}\n{% endfor %}")
    fake = SimpleNamespace(_template_tools=True, _tokenizer=tokenizer)
    history = Prompt(messages=(*CHAT.messages, Message("assistant", "", (ToolCall(0, "call_1", "get_weather",
                                                                                  '{"city": "Paris"}'),))))
    shown = tokenizer.decode(VllmBackend.tokenize_chat(fake, history, Tools(OFFERED, "auto")))  # type: ignore[arg-type]
    assert "TOOL get_weather" in shown and '"maxLength": 20' in shown and "CALL get_weather Paris" in shown
    assert "TOOL" not in tokenizer.decode(VllmBackend.tokenize_chat(fake, history, Tools(OFFERED, "none")))
    assert "<tools>" in real_vllm._tokenizer.decode(real_vllm.tokenize_chat(CHAT, Tools(OFFERED, "auto")))

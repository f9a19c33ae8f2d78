"""The tools, questions and generated schemas the tool-calling tests share (llama.cpp's and vLLM's)."""

from __future__ import annotations

import json

import jsonschema
from hypothesis import strategies as st

WEATHER = {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def valid(call, names=tuple(SCHEMAS)) -> dict:
    """The call's arguments, checked against its function's schema."""
    assert call.function.name in names and call.id.startswith("call_") and call.type == "function"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args



def agent_loop(client, model: str, choices: tuple[str, ...] = ("required", "auto", "auto", "none")) -> tuple:
    """Call, the tool's result, answer: the loop an agent framework runs with the openai client, one turn a
    tool_choice (auto after the first, required, turn; none last, as frameworks cap their iterations),
    until the model answers in text. Every call is checked (``valid``). Returns (last response, messages)."""
    messages: list = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    for choice in choices:
        resp = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                              parallel_tool_calls=False, temperature=0, max_tokens=60)
        if resp.choices[0].finish_reason != "tool_calls":
            break
        messages.append(resp.choices[0].message.model_dump(exclude_none=True))
        for call in resp.choices[0].message.tool_calls:
            args = valid(call)
            result = {"city": args.get("city"), "weather": "sunny, 21 C"} if call.function.name == "get_weather" \
                else {"time": "12:00"}
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    return resp, messages


# --- generated schemas within the bounds ----------------------------------------------------

NAMES = st.from_regex(r"[a-z][a-z_]{0,10}", fullmatch=True)
LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 24)),
    st.just({"type": "integer"}), st.just({"type": "number"}), st.just({"type": "boolean"}),
    st.builds(lambda vs: {"enum": vs}, st.lists(NAMES, min_size=1, max_size=4, unique=True)),
    st.builds(lambda n: {"type": "array", "items": {"type": "integer"}, "maxItems": n}, st.integers(1, 4)))


def objects(values):
    """Objects of 1-4 properties, some required. No additional properties: a schema that allows
    them lets the model add properties until max_tokens (valid, but a "length" answer with no call)."""
    return st.dictionaries(NAMES, values, min_size=1, max_size=4).flatmap(
        lambda props: st.builds(lambda req: {"type": "object", "properties": props, "required": req,
                                             "additionalProperties": False},
                                st.lists(st.sampled_from(sorted(props)), unique=True)))


SCHEMA = objects(st.one_of(LEAVES, objects(LEAVES)))

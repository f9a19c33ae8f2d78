"""The tools, questions and generated schemas the tool-calling tests share (llama.cpp's and vLLM's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
from hypothesis import strategies as st

from llmesh.v1 import common_pb2, gateway_pb2

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


def grpc_chat(stub, model: str, tools: list[dict], choice, content: str = ASK[0]["content"],
              parallel: bool = False, **sampling) -> tuple[list, list]:
    """A chat with ``tools`` on the gRPC front: (the replies, each call's (id, name, arguments),
    joined from its pieces by index)."""
    request = gateway_pb2.ChatRequest(
        model=model, messages=[common_pb2.ChatMessage(role="user", content=content)],
        sampling=common_pb2.SamplingParams(**sampling),
        tools=[gateway_pb2.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                                parameters=json.dumps(t["function"]["parameters"])) for t in tools],
        tool_choice=choice, parallel_tool_calls=parallel)
    replies = list(stub.Chat(request, timeout=180))
    calls: dict[int, list] = {}
    for tc in (tc for r in replies for tc in r.tool_calls):
        calls.setdefault(tc.index, []).append(tc)
    joined = [("".join(p.id for p in pieces), "".join(p.name for p in pieces), "".join(p.arguments for p in pieces))
              for _, pieces in sorted(calls.items())]
    return replies, joined


def required_call(client, stub, model: str, schema: dict, front: str) -> tuple[list[str], list[str], str]:
    """A required call of one tool with ``schema`` on ``front``: (finish reasons, names, arguments)."""
    tool = {"type": "function", "function": {"name": "act", "description": "Do it", "parameters": schema}}
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Call the tool."}], tools=[tool],
                  tool_choice="required", parallel_tool_calls=False, temperature=0.8, seed=1, max_tokens=1000)
    if front == "grpc":  # gRPC streams always
        replies, joined = grpc_chat(stub, model, [tool], gateway_pb2.ToolChoice(mode="required"), "Call the tool.",
                                    temperature=0.8, seed=1, max_tokens=1000)
        return ([common_pb2.FinishReason.Name(r.finish_reason).removeprefix("FINISH_REASON_").lower()
                 for r in replies if r.finish_reason], [c[1] for c in joined], "".join(c[2] for c in joined))
    if front == "http-stream":
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        pieces = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls
                  for tc in c.choices[0].delta.tool_calls]
        return ([c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason],
                [p.function.name for p in pieces if p.function.name],
                "".join(p.function.arguments or "" for p in pieces))
    resp = client.chat.completions.create(**kwargs)
    calls = resp.choices[0].message.tool_calls or []
    names = [c.function.name for c in calls]
    return [resp.choices[0].finish_reason], names, "".join(c.function.arguments for c in calls)


def run_example(mesh, name: str, question: str = "What is the weather in Paris?") -> list[str]:
    """examples/python/``name`` against the mesh's gateway: its output's lines (it must exit 0)."""
    example = Path(__file__).resolve().parents[2] / "examples" / "python" / name
    out = subprocess.run([sys.executable, str(example), "--base-url", mesh.layout.http_url + "/v1", question],
                         capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


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

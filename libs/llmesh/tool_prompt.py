"""Tools in a chat, as an llmesh engine shows them to a model (pure: no gRPC, no backend).

The offered tools go into the system message and the history's calls and results into
ordinary messages, in the Hermes format (Qwen2.5 and SmolLM3 are trained on it; vLLM's
``hermes`` parser reads it): a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
a tool's result a user turn ``<tool_response>\\n...\\n</tool_response>``. The model's own chat
template is not asked to render tools: SmolLM2's has no tools, and a template that has them
(Llama 3.1's ``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``) would describe a call format other than
the one the engine's grammar enforces. So any chat template applies to the rendered messages."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from llmesh.types import Message, Prompt, Tools

# calls in one answer with parallel_tool_calls (OpenAI sets no number; a bound keeps it finite): every engine's
MAX_PARALLEL_CALLS = 8
CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
CALL_HEAD = '{"name": '        # a call's JSON starts so, then the name, then ARGUMENTS_KEY
ARGUMENTS_KEY = ', "arguments": '
INTRO = ("You may call one or more functions to assist with the user query. The functions are listed "
         "within <tools></tools> as JSON:\n<tools>\n")
HOWTO = ("\n</tools>\nTo call a function, answer with its name and arguments as a JSON object within "
         "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
         "<arguments-json-object>}\n</tool_call>")


def offered(tools: Tools | None) -> Tools | None:
    """The tools the model is offered: none with ``tool_choice`` "none" or without functions."""
    if tools is None or not tools.functions or tools.choice == "none":
        return None
    return tools


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (``arguments``: JSON text, kept as it is)."""
    return f"{CALL_OPEN}{CALL_HEAD}{json.dumps(name)}{ARGUMENTS_KEY}{arguments or '{}'}}}{CALL_CLOSE}"


def arguments_schema(parameters: str) -> Any:
    """A function's parameters schema (JSON text) as its calls' arguments follow it: an object
    (OpenAI's parameters are one) when the schema does not say which type, ``{"type": "object"}``
    when there is none. Both engines constrain calls by it."""
    schema = json.loads(parameters) if parameters else {"type": "object"}
    if isinstance(schema, dict) and not schema.keys() & {"type", "$ref", "anyOf", "oneOf", "allOf", "enum", "const"}:
        schema = {**schema, "type": "object"}
    return schema


def tools_text(tools: Tools) -> str:
    lines = []
    for t in tools.functions:
        function: dict[str, object] = {"name": t.name}
        if t.description:
            function["description"] = t.description
        function["parameters"] = json.loads(t.parameters) if t.parameters else {"type": "object"}
        lines.append(json.dumps({"type": "function", "function": function}))
    return INTRO + "\n".join(lines) + HOWTO


def render(prompt: Prompt, tools: Tools | None) -> Prompt:
    """The chat with the offered tools (``offered(tools)``) in its system message, each
    assistant's calls in its text and each tool message as a user turn; a plain chat with no
    tools offered comes back as it is."""
    shown = offered(tools)
    messages = list(prompt.messages or ())
    if shown is None and not any(m.role == "tool" or m.tool_calls for m in messages):
        return prompt
    out = [_message(m) for m in messages]
    if shown is not None:
        text = tools_text(shown)
        if out and out[0].role == "system":
            out[0] = replace(out[0], content=f"{out[0].content}\n\n{text}" if out[0].content else text)
        else:
            out.insert(0, Message("system", text))
    return Prompt(messages=tuple(out))


def _message(m: Message) -> Message:
    if m.role == "tool":
        return Message("user", f"<tool_response>\n{m.content}\n</tool_response>")
    if m.tool_calls:
        calls = "\n".join(call_text(c.name, c.arguments) for c in m.tool_calls)
        return Message(m.role, f"{m.content}\n{calls}" if m.content else calls)
    return m

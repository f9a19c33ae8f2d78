"""Request rules that hold whatever the transport: the gateway checks them before
routing (for gRPC and HTTP callers alike), the engine again before decoding (gRPC
clients may call it directly).

The limits are declared once, as protovalidate rules (buf.validate) in protos/ where
clients can read them, and enforced by buf's own validator: a domain request is
checked in its protobuf form (llmesh.convert), so a rule changed in a .proto changes
every front at once. What the rules cannot say (a JSON Schema that must parse and stay
within the schema bounds, the wire types' ranges before anything is encoded, what an
engine cannot do) is here."""

from __future__ import annotations

import functools
from collections.abc import Callable

import protovalidate
from buf.validate import validate_pb2
from google.protobuf.message import Message as PbMessage

from llmesh.convert import request_to_pb, sampling_to_pb
from llmesh.errors import InvalidArgument
from llmesh.schema_bounds import check_request_size, check_schema
from llmesh.types import Prompt, ResponseFormat, Sampling, Tools
from llmesh.v1 import common_pb2, gateway_pb2

# The wire types of SamplingParams (common.proto): max_tokens is a uint32, seed an int64, top_k an int32.
# Out of these ranges a value cannot even be encoded, so they are checked first.
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
SCHEMA_PARAM = "response_format.json_schema.schema"


@functools.cache
def _validator() -> protovalidate.Validator:
    """One per process: it compiles each message type's rules once, on first use."""
    return protovalidate.Validator()


def field_path(violation: protovalidate.Violation) -> str:
    """``messages[3].role``, ``sampling.temperature``: the field as a caller names it."""
    out: list[str] = []
    path = violation.proto.field  # None for a rule on the message as a whole: no field to name
    for element in path.elements if path is not None else ():
        out.append(("." if out else "") + element.field_name)
        if element.subscript is not None:
            out.append(f"[{element.subscript.value}]")
    return "".join(out)


def check_message(msg: PbMessage, name: Callable[[str], str] = lambda path: path) -> None:
    """Raises InvalidArgument naming the first field that breaks its proto rules
    (``name`` turns a proto field path into the caller's name for it)."""
    violations = _validator().collect_violations(msg, fail_fast=True)
    if violations:
        param = name(field_path(violations[0]))
        raise InvalidArgument(f"Invalid value for '{param}': {violations[0].proto.message}.", param=param)


def rule(message_type: type[PbMessage], field: str) -> validate_pb2.FieldRules:
    """The buf.validate rules of one field (e.g. ``rule(ChatRequest, "n").uint32.lte``)."""
    # protoc's .pyi types the extension as a plain FieldDescriptor, which Extensions[] does not accept
    rules: validate_pb2.FieldRules = (
        message_type.DESCRIPTOR.fields_by_name[field].GetOptions().Extensions[validate_pb2.field])  # type: ignore[index]
    return rules


@functools.cache
def _texts_ruled() -> bool:
    """Whether the protos put a rule on a prompt's texts (ChatMessage.content,
    CompleteRequest.prompt); if not, they are not copied just to be checked."""
    return bool(rule(common_pb2.ChatMessage, "content").ListFields()
                or rule(gateway_pb2.CompleteRequest, "prompt").ListFields())


def _wire_ranges(s: Sampling) -> None:
    if s.max_tokens is not None and not 0 <= s.max_tokens <= UINT32_MAX:
        raise InvalidArgument(f"max_tokens must be between 1 and {UINT32_MAX}, got {s.max_tokens}.",
                              param="max_tokens")
    if s.seed is not None and not INT64_MIN <= s.seed <= INT64_MAX:
        raise InvalidArgument(f"seed must be between {INT64_MIN} and {INT64_MAX}, got {s.seed}.", param="seed")
    if s.top_k is not None and not INT32_MIN <= s.top_k <= INT32_MAX:
        raise InvalidArgument(f"top_k must be between -1 and 1048576, got {s.top_k}.", param="top_k")
    if s.logprobs is not None and not 0 <= s.logprobs <= UINT32_MAX:
        raise InvalidArgument(f"top_logprobs is out of range, got {s.logprobs}.", param="top_logprobs")


def http_name(path: str, chat: bool) -> str:
    """A proto field path as the OpenAI API names the parameter."""
    if path == "sampling.logprobs":
        return "top_logprobs" if chat else "logprobs"
    if path.startswith("sampling.response_format.json_schema"):
        return "response_format.json_schema"
    if path.startswith("tool_choice."):
        return "tool_choice"
    return path.removeprefix("sampling.")


def check_sampling(s: Sampling, chat: bool = True) -> None:
    _wire_ranges(s)
    check_message(sampling_to_pb(s), lambda path: http_name("sampling." + path, chat))
    if s.response_format is not None:
        check_response_format(s.response_format)


def check_response_format(f: ResponseFormat) -> None:
    """What the proto's rules cannot say: a schema only with json_schema, and one that
    parses to a JSON object within the schema bounds (llmesh.schema_bounds)."""
    if f.type != "json_schema":
        if f.schema is not None:
            raise InvalidArgument(f"response_format of type '{f.type}' takes no schema.",
                                  param="response_format")
        return
    if not f.schema:
        raise InvalidArgument("response_format json_schema needs a schema.", param="response_format.json_schema")
    check_schema(f.schema, SCHEMA_PARAM)


def uses_tools(prompt: Prompt, tools: Tools | None) -> str | None:
    """The parameter that needs tool calling (``tools``, ``messages[i].role``...), if any."""
    if tools is not None and tools.functions:
        return "tools"
    for i, m in enumerate(prompt.messages or ()):
        if m.role == "tool":
            return f"messages[{i}].role"
        if m.tool_calls:
            return f"messages[{i}].tool_calls"
    return None


def check_choices(n: int) -> None:
    """``n`` against the ChatRequest/CompleteRequest rule (1..16)."""
    if not 0 <= n <= UINT32_MAX:
        raise InvalidArgument(f"n is out of range, got {n}.", param="n")
    check_message(gateway_pb2.CompleteRequest(model="n", n=n))


def check_embed(model: str, inputs: tuple[str, ...], user: str | None = None, dimensions: int | None = None) -> None:
    """An embeddings request against the gateway's GatewayEmbedRequest rules (errors name fields
    as the OpenAI API does: ``input[3]``)."""
    if dimensions is not None and not 0 <= dimensions <= UINT32_MAX:
        raise InvalidArgument(f"dimensions is out of range, got {dimensions}.", param="dimensions")
    pb = gateway_pb2.GatewayEmbedRequest(model=model, inputs=inputs, user=user or "", dimensions=dimensions)
    check_message(pb, lambda path: path.replace("inputs", "input", 1))


def check_request(model: str, prompt: Prompt, sampling: Sampling, *, user: str | None = None,
                  tools: Tools | None = None, tools_allowed: bool = False, rules_checked: bool = False) -> None:
    """Every rule of the request as the gateway's ChatRequest/CompleteRequest states
    them (errors name fields as the OpenAI API does), and what they cannot state.
    ``tools_allowed``: the caller can serve tool calls (the gateway, for providers); an
    engine cannot. ``rules_checked``: the protobuf request was checked as it arrived."""
    _wire_ranges(sampling)
    if not tools_allowed and (param := uses_tools(prompt, tools)) is not None:
        raise InvalidArgument("This model is served by an llmesh engine, which cannot call tools; "
                              f"'{param}' needs an OpenAI-compatible provider.", param=param)
    if not rules_checked:
        check_message(request_to_pb(model, prompt, sampling, user=user, tools=tools, texts=_texts_ruled()),
                      lambda path: http_name(path, prompt.is_chat))
    check_schemas_size(sampling, tools)
    if sampling.response_format is not None:
        check_response_format(sampling.response_format)
    if tools is not None:
        check_tools(tools)


def check_tools(tools: Tools) -> None:
    for i, tool in enumerate(tools.functions):
        if tool.parameters:
            check_schema(tool.parameters, f"tools[{i}].function.parameters")
    if tools.choice == "function":
        if tools.function not in {t.name for t in tools.functions}:
            raise InvalidArgument(f"tool_choice names the function '{tools.function}', which is not in tools.",
                                  param="tool_choice")
    elif tools.choice in ("required",) and not tools.functions:
        raise InvalidArgument("tool_choice 'required' needs tools.", param="tool_choice")


def check_schemas_size(sampling: Sampling, tools: Tools | None) -> None:
    """The request's JSON schemas together, before any of them is walked."""
    sizes = []
    fmt = sampling.response_format
    if fmt is not None and fmt.schema:
        sizes.append((SCHEMA_PARAM, len(fmt.schema)))
    for i, tool in enumerate(tools.functions if tools is not None else ()):
        sizes.append((f"tools[{i}].function.parameters", len(tool.parameters)))
    if sizes:
        check_request_size(sizes)

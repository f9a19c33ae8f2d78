"""Domain types <-> llmesh.v1 protobuf messages, in one place for every service."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from google.protobuf.message import Message as PbMessage

from llmesh.errors import InvalidArgument
from llmesh.kvhash import HashScheme
from llmesh.types import (KNOBS, FinishReason, Gpu, Hardware, Message, Priority, Prompt, ResponseFormat, Sampling,
                          SelfTest, TokenLogprob, Tool, ToolCall, Tools, Usage)
from llmesh.v1 import common_pb2, gateway_pb2, scheduler_pb2

_FINISH_TO_PB = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.TOOL_CALLS: common_pb2.FINISH_REASON_TOOL_CALLS,
}
_FINISH_FROM_PB: dict[int, FinishReason] = {v: k for k, v in _FINISH_TO_PB.items()}

_PRIORITY_TO_PB = {
    Priority.LOW: common_pb2.PRIORITY_LOW,
    Priority.NORMAL: common_pb2.PRIORITY_NORMAL,
    Priority.HIGH: common_pb2.PRIORITY_HIGH,
}
_PRIORITY_FROM_PB: dict[int, Priority] = {**{v: k for k, v in _PRIORITY_TO_PB.items()},
                                          common_pb2.PRIORITY_UNSPECIFIED: Priority.NORMAL}

# KV block events: kinds as the engines' and the scheduler's domain code names them.
_KV_KIND_TO_PB = {"stored": scheduler_pb2.KvEvent.STORED, "removed": scheduler_pb2.KvEvent.REMOVED,
                  "cleared": scheduler_pb2.KvEvent.CLEARED}
_KV_KIND_FROM_PB = {v: k for k, v in _KV_KIND_TO_PB.items()}


def kv_event_to_pb(kind: str, hashes: tuple[int, ...]) -> scheduler_pb2.KvEvent:
    return scheduler_pb2.KvEvent(kind=_KV_KIND_TO_PB[kind], block_hashes=hashes)


def kv_event_from_pb(pb: scheduler_pb2.KvEvent) -> tuple[str, tuple[int, ...]]:
    """(kind, hashes); an unknown kind comes back as "" and is ignored by the index."""
    return _KV_KIND_FROM_PB.get(pb.kind, ""), tuple(pb.block_hashes)


def kv_hash_to_pb(scheme: HashScheme | None) -> scheduler_pb2.KvHashScheme | None:
    if scheme is None:
        return None
    return scheduler_pb2.KvHashScheme(kind=scheme.kind, block_size=scheme.block_size, algo=scheme.algo,
                                      seed=scheme.seed, hash_block_size=scheme.hash_block_size)


def kv_hash_from_pb(pb: scheduler_pb2.KvHashScheme) -> HashScheme | None:
    """None for an unset or unusable scheme: that engine's blocks then match no request."""
    if not pb.kind:
        return None
    try:
        return HashScheme(pb.kind, pb.block_size, pb.algo, pb.seed, pb.hash_block_size)
    except ValueError:
        return None


def hardware_to_pb(h: Hardware) -> scheduler_pb2.HardwareProfile:
    return scheduler_pb2.HardwareProfile(
        cpu_model=h.cpu_model, cpu_cores=h.cpu_cores, memory_total_bytes=h.memory_total_bytes,
        memory_available_bytes=h.memory_available_bytes,
        gpus=[scheduler_pb2.GpuInfo(name=g.name, memory_total_bytes=g.memory_total_bytes,
                                    memory_used_bytes=g.memory_used_bytes, ecc_errors_corrected=g.ecc_corrected,
                                    ecc_errors_uncorrected=g.ecc_uncorrected, driver_version=g.driver_version)
              for g in h.gpus])


def hardware_from_pb(pb: scheduler_pb2.HardwareProfile) -> Hardware:
    return Hardware(pb.cpu_model, pb.cpu_cores, pb.memory_total_bytes, pb.memory_available_bytes,
                    tuple(Gpu(g.name, g.memory_total_bytes, g.memory_used_bytes, g.ecc_errors_corrected,
                              g.ecc_errors_uncorrected, g.driver_version) for g in pb.gpus))


def self_test_to_pb(t: SelfTest) -> scheduler_pb2.SelfTest:
    return scheduler_pb2.SelfTest(ok=t.ok, detail=t.detail, checked_unix=t.checked_unix, latency_ms=t.latency_ms)


def self_test_from_pb(pb: scheduler_pb2.SelfTest) -> SelfTest:
    return SelfTest(pb.ok, pb.detail, pb.checked_unix, pb.latency_ms)


def sampling_to_pb(s: Sampling) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(stop=list(s.stop))
    if s.max_tokens is not None:
        pb.max_tokens = s.max_tokens
    if s.temperature is not None:
        pb.temperature = s.temperature
    if s.top_p is not None:
        pb.top_p = s.top_p
    if s.seed is not None:
        pb.seed = s.seed
    if s.logprobs is not None:
        pb.logprobs = s.logprobs
    if s.response_format is not None:
        pb.response_format.type = s.response_format.type
        pb.response_format.json_schema = s.response_format.schema or ""
    for name in KNOBS:
        value = getattr(s, name)
        if value is not None:
            setattr(pb, name, value)
    return pb


def sampling_from_pb(pb: common_pb2.SamplingParams) -> Sampling:
    return Sampling(
        max_tokens=pb.max_tokens if pb.HasField("max_tokens") else None,
        temperature=pb.temperature if pb.HasField("temperature") else None,
        top_p=pb.top_p if pb.HasField("top_p") else None,
        stop=tuple(pb.stop),
        seed=pb.seed if pb.HasField("seed") else None,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        response_format=(ResponseFormat(pb.response_format.type, pb.response_format.json_schema or None)
                         if pb.HasField("response_format") else None),
        **{name: getattr(pb, name) for name in KNOBS if pb.HasField(name)},
    )


def logprobs_to_pb(items: tuple[TokenLogprob, ...]) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(token=t.token, logprob=t.logprob,
                                    top=[common_pb2.TokenLogprob.Alternative(token=a, logprob=lp) for a, lp in t.top])
            for t in items]


def logprobs_from_pb(pbs: Iterable[common_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(t.token, t.logprob, tuple((a.token, a.logprob) for a in t.top)) for t in pbs)


def tool_calls_to_pb(calls: tuple[ToolCall, ...]) -> list[common_pb2.ToolCall]:
    return [common_pb2.ToolCall(index=c.index, id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def tool_calls_from_pb(pbs: Iterable[common_pb2.ToolCall]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.index, c.id, c.name, c.arguments) for c in pbs)


def messages_to_pb(messages: tuple[Message, ...]) -> list[common_pb2.ChatMessage]:
    return [common_pb2.ChatMessage(role=m.role, content=m.content, tool_calls=tool_calls_to_pb(m.tool_calls),
                                   tool_call_id=m.tool_call_id) if m.tool_calls or m.tool_call_id
            else common_pb2.ChatMessage(role=m.role, content=m.content) for m in messages]


def messages_from_pb(pbs: Iterable[common_pb2.ChatMessage]) -> tuple[Message, ...]:
    return tuple(Message(role=m.role, content=m.content, tool_calls=tool_calls_from_pb(m.tool_calls),
                         tool_call_id=m.tool_call_id) if m.tool_calls or m.tool_call_id
                 else Message(role=m.role, content=m.content) for m in pbs)


def tools_to_pb(tools: Tools) -> dict[str, Any]:
    """The ``tools``, ``tool_choice`` and ``parallel_tool_calls`` fields of a ChatRequest (or a GenerateRequest)."""
    out: dict[str, Any] = {"tools": [gateway_pb2.Tool(name=t.name, description=t.description, parameters=t.parameters,
                                            strict=t.strict) for t in tools.functions],
                 "tool_choice": gateway_pb2.ToolChoice(mode=tools.choice, function=tools.function)}
    if tools.parallel is not None:
        out["parallel_tool_calls"] = tools.parallel
    return out


def tools_from_pb(pb: Any) -> Tools | None:
    """A ChatRequest's or a GenerateRequest's tools (the same fields); None when the request
    neither offers tools nor says how to use them."""
    if not pb.tools and not pb.HasField("tool_choice") and not pb.HasField("parallel_tool_calls"):
        return None
    return Tools(functions=tuple(Tool(t.name, t.description, t.parameters, t.strict if t.HasField("strict") else None)
                                 for t in pb.tools),
                 choice=pb.tool_choice.mode or "auto", function=pb.tool_choice.function,
                 parallel=pb.parallel_tool_calls if pb.HasField("parallel_tool_calls") else None)


@functools.lru_cache(maxsize=64)
def _role_only(role: str) -> common_pb2.ChatMessage:
    """A message with only its role (copied into each request that holds one): cheaper
    than building it anew when only the rules on roles are to be checked."""
    return common_pb2.ChatMessage(role=role)


def request_to_pb(model: str, prompt: Prompt, sampling: Sampling, *, user: str | None = None,
                  tools: Tools | None = None,
                  texts: bool = True) -> gateway_pb2.ChatRequest | gateway_pb2.CompleteRequest:
    """A domain request as the Gateway's ChatRequest (a chat) or CompleteRequest.
    ``texts=False`` leaves the prompt's texts out (for checking rules that have none on them)."""
    common: dict[str, Any] = {"model": model, "sampling": sampling_to_pb(sampling), "user": user or ""}
    if prompt.messages is None:
        return gateway_pb2.CompleteRequest(prompt=prompt.text or "" if texts else "", **common)
    extra = tools_to_pb(tools) if tools is not None else {}
    if texts:
        messages = messages_to_pb(prompt.messages)
    else:
        messages = [common_pb2.ChatMessage(role=m.role, tool_calls=tool_calls_to_pb(m.tool_calls),
                                           tool_call_id=m.tool_call_id) if m.tool_calls or m.tool_call_id
                    else _role_only(m.role) for m in prompt.messages]
    return gateway_pb2.ChatRequest(messages=messages, **common, **extra)


def prompt_fields(prompt: Prompt, chat_type: Callable[..., PbMessage]) -> dict[str, Any]:
    """Keyword arguments that set a message's ``input`` oneof (``chat`` or ``prompt``)."""
    if prompt.messages is not None:
        return {"chat": chat_type(messages=messages_to_pb(prompt.messages))}
    return {"prompt": prompt.text or ""}


def prompt_from_pb(pb: Any) -> Prompt:
    """Reads the ``input`` oneof of a request that has ``chat`` and ``prompt`` (several message types)."""
    if pb.WhichOneof("input") == "chat":
        return Prompt(messages=messages_from_pb(pb.chat.messages))
    return Prompt(text=pb.prompt)


def finish_to_pb(reason: FinishReason) -> common_pb2.FinishReason:
    return _FINISH_TO_PB[reason]


def finish_from_pb(value: int) -> FinishReason:
    return _FINISH_FROM_PB.get(value, FinishReason.STOP)


def priority_to_pb(p: Priority) -> common_pb2.Priority:
    return _PRIORITY_TO_PB[p]


def priority_from_pb(value: int) -> Priority:
    """Unset is NORMAL; a value this version does not know is refused, not guessed."""
    try:
        return _PRIORITY_FROM_PB[value]
    except KeyError:
        raise InvalidArgument(f"Unknown priority {value}; expected one of "
                              f"{', '.join(common_pb2.Priority.keys())}.", param="priority") from None


def usage_to_pb(u: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens)


def usage_from_pb(pb: common_pb2.Usage) -> Usage:
    return Usage(prompt_tokens=pb.prompt_tokens, completion_tokens=pb.completion_tokens)

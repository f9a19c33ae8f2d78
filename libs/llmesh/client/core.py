"""What the sync and async clients share: the Gateway's methods read from its
descriptor, requests built from keyword arguments, call metadata, deadlines,
the retry policy and the collected answer. No I/O here."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any

import grpc
from google.protobuf import json_format, message_factory
from google.protobuf.message import Message

from llmesh.backoff import Backoff
from llmesh.v1 import gateway_pb2
from llmesh.v1 import common_pb2

# Keyword arguments that are not fields of the request itself are looked up in
# these message fields of it, so ``temperature=0`` lands in ``sampling``.
NESTED_FIELDS = ("sampling",)

Response = gateway_pb2.ChatResponse | gateway_pb2.CompleteResponse
# A call's timeout: seconds, None for no deadline, ``...`` for the client's default.
Timeout = float | None | EllipsisType
CallMetadata = Mapping[str, str] | Iterable[tuple[str, str]] | None  # extra metadata for one call


@dataclass(frozen=True)
class Method:
    path: str                  # "/llmesh.v1.Gateway/Chat"
    request_type: type[Message]
    response_type: type[Message]


def gateway_methods() -> dict[str, Method]:
    """The Gateway service's methods by name, from the generated descriptor: the
    client follows the proto (new fields, renamed messages) without code changes."""
    (service,) = gateway_pb2.DESCRIPTOR.services_by_name.values()
    return {m.name: Method(f"/{service.full_name}/{m.name}", message_factory.GetMessageClass(m.input_type),
                           message_factory.GetMessageClass(m.output_type))
            for m in service.methods}


def _plain(value: Any) -> Any:
    """Protobuf messages inside keyword arguments, as dicts for ParseDict."""
    if isinstance(value, Message):
        return json_format.MessageToDict(value, preserving_proto_field_name=True)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def build_request(request_type: type[Message], request: Message | None, fields: dict[str, Any]) -> Message:
    """A copy of ``request`` (or an empty one) with ``fields`` set. A keyword that is a
    field of the request replaces its value; one that is a field of a NESTED_FIELDS
    message replaces that field there. Values may be plain Python (dicts for messages,
    enum names) or messages; None leaves a field as it is."""
    out = request_type()
    if request is not None:
        out.CopyFrom(request)
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    names = request_type.DESCRIPTOR.fields_by_name
    for key, value in fields.items():
        if value is None:
            continue
        if key in names:
            top[key] = _plain(value)
            out.ClearField(key)
            continue
        holder = next((n for n in NESTED_FIELDS if n in names and (kind := names[n].message_type) is not None
                       and key in kind.fields_by_name), None)
        if holder is None:
            raise TypeError(f"{request_type.__name__} has no field {key!r}")
        nested.setdefault(holder, {})[key] = _plain(value)
        getattr(out, holder).ClearField(key)
    for holder, values in nested.items():
        top[holder] = {**top.get(holder, {}), **values}  # never the caller's own dict
    try:
        out.MergeFrom(json_format.ParseDict(top, request_type()))
    except json_format.ParseError as exc:  # a value of the wrong type or out of the wire type's range
        raise ValueError(str(exc)) from None
    return out


def call_metadata(credential: str | None, extra: CallMetadata) -> tuple[tuple[str, str], ...]:
    md = [("authorization", f"Bearer {credential}")] if credential else []
    md.extend(dict(extra or {}).items())
    return tuple(md)


class Deadline:
    """One deadline over all the attempts of a call."""

    def __init__(self, timeout_s: float | None):
        self._at = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        return None if self._at is None else max(0.0, self._at - time.monotonic())


@dataclass(frozen=True)
class RetryPolicy:
    """Retries on UNAVAILABLE only, and for a stream only before its first message:
    once tokens were yielded a retry would repeat them. Waits double from
    ``initial_backoff_s`` up to ``max_backoff_s``, each jittered down by up to ``jitter``
    of it (``rng``: a seeded one for reproducible waits)."""
    max_attempts: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    jitter: float = 0.5
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)
    _backoff: Backoff = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_backoff", Backoff(initial_s=self.initial_backoff_s, max_s=self.max_backoff_s,
                                                     jitter=self.jitter, rng=self.rng))

    def delay(self, code: grpc.StatusCode, attempts: int, deadline: Deadline) -> float | None:
        """Seconds to wait before the next attempt, or None: do not retry."""
        if code != grpc.StatusCode.UNAVAILABLE or attempts >= self.max_attempts:
            return None
        wait = self._backoff.delay(attempts)
        remaining = deadline.remaining()
        return None if remaining is not None and remaining <= wait else wait


@dataclass
class Choice:
    """One answer of a call, joined from its streamed messages (those with its ``index``)."""
    index: int
    text: str = ""
    role: str = ""                 # "assistant" for a chat answer; empty for a text completion
    finish_reason: int = 0         # a common_pb2.FinishReason value; 0 while the choice is unfinished
    usage: common_pb2.Usage | None = None   # the prompt's and this choice's tokens, from its last message
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)  # one per token, in order
    tool_calls: list[common_pb2.ToolCall] = field(default_factory=list)  # whole calls, ordered by their index


def _add_tool_call(calls: dict[int, common_pb2.ToolCall], piece: common_pb2.ToolCall) -> None:
    """Join a streamed tool-call piece onto the call with its index: the first piece
    names the call (id, function name), the following ones carry more argument text."""
    call = calls.get(piece.index)
    if call is None:
        call = calls[piece.index] = type(piece)()
        call.CopyFrom(piece)
        return
    call.id = call.id or piece.id
    call.name = call.name or piece.name
    call.arguments += piece.arguments


def collect_choices(responses: list[Response]) -> list[Choice]:
    """The answers in ChatResponse or CompleteResponse messages, by index: n > 1
    choices interleave on the stream and are told apart by their ``index``."""
    choices: dict[int, Choice] = {}
    texts: dict[int, list[str]] = {}
    calls: dict[int, dict[int, common_pb2.ToolCall]] = {}
    for response in responses:
        i = response.index
        choice = choices.setdefault(i, Choice(index=i))
        texts.setdefault(i, []).append(response.text)
        choice.role = choice.role or getattr(response, "role", "")
        choice.logprobs.extend(response.logprobs)
        for piece in getattr(response, "tool_calls", ()):
            _add_tool_call(calls.setdefault(i, {}), piece)
        if response.finish_reason:
            choice.finish_reason = response.finish_reason
        if response.HasField("usage"):
            choice.usage = response.usage
    for i, choice in choices.items():
        choice.text = "".join(texts[i])
        choice.tool_calls = [calls[i][k] for k in sorted(calls.get(i, {}))]
    return [choices[i] for i in sorted(choices)]


@dataclass
class Result:
    """A whole answer (Chat or Complete) collected from the stream. ``choices`` has one
    Choice per index; ``text``, ``finish_reason``, ``usage``, ``logprobs`` and
    ``tool_calls`` are choice 0's, the whole answer when n is 1."""
    responses: list[Response] = field(default_factory=list)  # every ChatResponse/CompleteResponse, in order
    initial_metadata: dict[str, str] = field(default_factory=dict)  # e.g. x-llmesh-cache, rate-limit facts
    trailing_metadata: dict[str, str] = field(default_factory=dict)  # x-request-id, failover marker
    choices: list[Choice] = field(init=False)

    def __post_init__(self) -> None:
        self.choices = collect_choices(self.responses)

    @property
    def _first(self) -> Choice:
        return self.choices[0] if self.choices else Choice(index=0)

    @property
    def text(self) -> str:
        return self._first.text

    @property
    def finish_reason(self) -> int:
        return self._first.finish_reason

    @property
    def usage(self) -> common_pb2.Usage | None:
        return self._first.usage

    @property
    def logprobs(self) -> list[common_pb2.TokenLogprob]:
        return self._first.logprobs

    @property
    def tool_calls(self) -> list[common_pb2.ToolCall]:
        return self._first.tool_calls

    @property
    def id(self) -> str:
        return self.responses[0].id if self.responses else ""

    @property
    def model(self) -> str:
        return next((r.model for r in self.responses if r.model), "")

    @property
    def last(self) -> Response:
        return self.responses[-1]

    @property
    def request_id(self) -> str | None:
        return self.trailing_metadata.get("x-request-id")


def as_dict(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    return {key: value for key, value in (metadata or ()) if isinstance(value, str)}


def channel_credentials(tls: bool | grpc.ChannelCredentials) -> grpc.ChannelCredentials | None:
    if tls is True:
        return grpc.ssl_channel_credentials()
    return tls or None


class ClientBase:
    """What ``Client`` and ``AsyncClient`` share: the channel (from ``_grpc``, the
    ``grpc`` or ``grpc.aio`` module: the same calls), the Gateway's methods bound to
    it, and the parts of one call."""

    _grpc = grpc

    def __init__(self, address: str, *, credential: str | None = None, tls: bool | grpc.ChannelCredentials = False,
                 timeout_s: float | None = 60.0, retry: RetryPolicy | None = None,
                 options: Sequence[tuple[str, Any]] | None = None):
        creds = channel_credentials(tls)
        # grpc's or grpc.aio's channel and callables (the subclass's _grpc): typed Any here.
        self._channel: Any = (self._grpc.secure_channel(address, creds, options=options) if creds
                         else self._grpc.insecure_channel(address, options=options))
        self._credential = credential
        self._timeout_s = timeout_s
        self._retry = retry or RetryPolicy()
        self._methods = gateway_methods()
        self._streams: dict[str, Any] = {name: self._channel.unary_stream(
            m.path, request_serializer=m.request_type.SerializeToString,
            response_deserializer=m.response_type.FromString)
            for name, m in self._methods.items() if name in ("Chat", "Complete")}
        self._unaries: dict[str, Any] = {name: self._channel.unary_unary(
            m.path, request_serializer=m.request_type.SerializeToString,
            response_deserializer=m.response_type.FromString)
            for name, m in self._methods.items() if name in ("ListModels", "Embed")}

    def _deadline(self, timeout_s: Timeout) -> Deadline:
        """``...``: the client's default timeout; None: no deadline."""
        return Deadline(self._timeout_s if timeout_s is ... else timeout_s)

    def _unary_parts(self, method: str, request: Message | None, timeout_s: Timeout, metadata: CallMetadata,
                     fields: dict[str, Any]) -> tuple[Any, Message, tuple[tuple[str, str], ...], Deadline]:
        """A unary call's callable, request, metadata and deadline."""
        return (self._unaries[method], build_request(self._methods[method].request_type, request, fields),
                call_metadata(self._credential, metadata), self._deadline(timeout_s))

    def _call_parts(self, method: str, request: Message | None, timeout_s: Timeout, metadata: CallMetadata,
                    fields: dict[str, Any]) -> tuple[Any, Message, tuple[tuple[str, str], ...], Deadline, RetryPolicy]:
        """A stream's arguments: its callable, request, metadata, deadline and retry policy."""
        return (self._streams[method], build_request(self._methods[method].request_type, request, fields),
                call_metadata(self._credential, metadata), self._deadline(timeout_s), self._retry)

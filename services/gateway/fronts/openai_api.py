"""OpenAI wire format: request bodies -> domain requests, domain results -> JSON.

Types are checked here (pydantic); value rules live in llmesh.validation so the
HTTP and gRPC fronts enforce the same ones."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmesh.errors import InvalidArgument
from llmesh.types import (FinishReason, Message, Prompt, ResponseFormat, Sampling, TokenLogprob, Tool, ToolCall, Tools,
                          Usage)
from llmesh.validation import check_choices
from llmesh.gateway.fronts.knobs import SamplingKnobs
# Fields we do not act on but that change nothing about the answer; any other field
# we do not know is refused (400 naming it) unless it holds the value that means "off".
HARMLESS = frozenset({"store", "metadata", "service_tier"})
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({}, None), "functions": ([], None), "function_call": ("none", None), "echo": (False, None),
    "best_of": (1, None), "suffix": (None, ""),
}
B = TypeVar("B", bound=BaseModel)  # parse's body class


class _JsonSchema(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class _ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None

    def to_domain(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat("json_object")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidArgument("response_format of type 'json_schema' needs json_schema.schema.",
                                  param="response_format.json_schema")
        return ResponseFormat("json_schema", json.dumps(self.json_schema.schema_))


class Body(SamplingKnobs):  # a chat's or a text completion's request body
    model_config = ConfigDict(extra="allow")  # checked in ``refuse_unsupported``: never silently dropped

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    n: int | None = None
    stream: bool | None = False
    response_format: _ResponseFormat | None = None

    class StreamOptions(BaseModel):
        include_usage: bool = False

    stream_options: StreamOptions | None = None

    def refuse_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in HARMLESS or value in OFF_VALUES.get(name, (None,)):
                continue
            raise InvalidArgument(f"The parameter '{name}' is not supported by this gateway.", param=name)

    @property
    def choices(self) -> int:
        n = 1 if self.n is None else self.n
        check_choices(n)
        return n

    def tools_value(self) -> Tools | None:
        return None

    def wanted_logprobs(self) -> int | None:
        """How many alternatives per token (0: the chosen token only); None: no logprobs."""
        return None

    def sampling(self, max_tokens: int | None) -> Sampling:
        self.refuse_unsupported()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return Sampling(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                        stop=stop, seed=self.seed, logprobs=self.wanted_logprobs(),
                        response_format=self.response_format.to_domain() if self.response_format else None,
                        **self.knob_values())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def prompt_value(self) -> Prompt:  # a chat's messages, a completion's text
        raise NotImplementedError

    def sampling_params(self) -> Sampling:
        raise NotImplementedError


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _Function(BaseModel):
    name: str
    arguments: str = ""


class _ToolCallIn(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: _Function


class _MessageIn(BaseModel):
    role: str
    content: str | list[_TextPart] | None = None
    tool_calls: list[_ToolCallIn] | None = None
    tool_call_id: str | None = None

    def to_domain(self) -> Message:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        calls = tuple(ToolCall(i, c.id, c.function.name, c.function.arguments)
                      for i, c in enumerate(self.tool_calls or ()))
        return Message(role="system" if self.role == "developer" else self.role, content=content,
                       tool_calls=calls, tool_call_id=self.tool_call_id or "")


class _FunctionDef(BaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class _ToolIn(BaseModel):
    type: Literal["function"]
    function: _FunctionDef

    def to_domain(self) -> Tool:
        f = self.function
        return Tool(f.name, f.description or "", json.dumps(f.parameters) if f.parameters is not None else "",
                    f.strict)


class _NamedFunction(BaseModel):
    name: str


class _NamedChoice(BaseModel):
    type: Literal["function"]
    function: _NamedFunction


class ChatBody(Body):
    messages: list[_MessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[_ToolIn] | None = None
    tool_choice: Literal["auto", "none", "required"] | _NamedChoice | None = None
    parallel_tool_calls: bool | None = None

    def tools_value(self) -> Tools | None:
        if not self.tools and self.tool_choice is None and self.parallel_tool_calls is None:
            return None
        choice, function = ((self.tool_choice.type, self.tool_choice.function.name)
                            if isinstance(self.tool_choice, _NamedChoice) else (self.tool_choice or "auto", ""))
        return Tools(functions=tuple(t.to_domain() for t in self.tools or ()), choice=choice, function=function,
                     parallel=self.parallel_tool_calls)

    def wanted_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise InvalidArgument("top_logprobs needs logprobs set to true.", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def prompt(self) -> Prompt:
        return Prompt(messages=tuple(m.to_domain() for m in self.messages))
    prompt_value = prompt  # a completion's ``prompt`` is its field

    def sampling_params(self) -> Sampling:
        return self.sampling(self.max_completion_tokens if self.max_completion_tokens is not None
                             else self.max_tokens)


class CompletionBody(Body):
    prompt: str | list[str]
    logprobs: int | None = None  # the legacy API's number of alternatives per token

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_value(self) -> Prompt:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise InvalidArgument("Only one prompt per request is supported.", param="prompt")
            return Prompt(text=self.prompt[0])
        return Prompt(text=self.prompt)

    def sampling_params(self) -> Sampling:
        return self.sampling(self.max_tokens if self.max_tokens is not None else 16)


def parse(body_cls: type[B], raw: bytes | bytearray) -> B:
    if not raw:
        raise InvalidArgument("The request body is empty; send a JSON object.")
    try:
        return body_cls.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "json_invalid":
            raise InvalidArgument(f"The request body is not valid JSON: {err['msg']}.") from None
        raise InvalidArgument(f"Invalid value for '{loc}': {err['msg']}.", param=loc or None) from None


@dataclass(slots=True)
class Shape:
    """What differs between chat and text completions on the wire."""
    object: str
    chunk_object: str
    id_prefix: str
    chat: bool


CHAT = Shape("chat.completion", "chat.completion.chunk", "chatcmpl-", True)
TEXT = Shape("text_completion", "text_completion", "cmpl-", False)


def usage_json(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}


@dataclass(slots=True)
class Choice:
    """One finished answer of a (possibly n > 1) request."""
    text: str
    finish: FinishReason
    logprobs: list[TokenLogprob] | None  # None: not asked for
    tool_calls: list[dict] | None = None  # joined from the streamed pieces (ToolCalls)


class ToolCalls:
    """Joins the streamed pieces of one answer's tool calls into OpenAI's message form."""

    def __init__(self) -> None:
        self._calls: dict[int, dict] = {}

    def add(self, pieces: tuple[ToolCall, ...]) -> None:
        for p in pieces:
            call = self._calls.setdefault(p.index, {"id": "", "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
            call["id"] = p.id or call["id"]
            call["function"]["name"] = p.name or call["function"]["name"]
            call["function"]["arguments"] += p.arguments

    def json(self) -> list[dict] | None:
        return [self._calls[i] for i in sorted(self._calls)] or None


def tool_call_deltas(pieces: tuple[ToolCall, ...]) -> list[dict]:
    """Streamed pieces as OpenAI's ``delta.tool_calls`` (id, type and name only where given)."""
    out = []
    for p in pieces:
        d: dict = {"index": p.index}
        if p.id:
            d["id"], d["type"] = p.id, "function"
        fn = {"arguments": p.arguments}
        if p.name:
            fn["name"] = p.name
        d["function"] = fn
        out.append(d)
    return out


def _alt(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def logprobs_json(shape: Shape, items: list[TokenLogprob] | tuple[TokenLogprob, ...] | None,
                  offset: int = 0) -> dict | None:
    """Chat: ``{"content": [...]}``; text completions: the legacy parallel lists
    (``text_offset`` counts characters from ``offset``)."""
    if items is None:
        return None
    if shape.chat:
        return {"content": [dict(_alt(t.token, t.logprob), top_logprobs=[_alt(a, lp) for a, lp in t.top])
                            for t in items], "refusal": None}
    offsets, at = [], offset
    for t in items:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [dict(t.top) for t in items], "text_offset": offsets}


def completion_json(shape: Shape, rid: str, model: str, choices: list[Choice], usage: Usage) -> dict:
    out = []
    for i, c in enumerate(choices):
        lp = logprobs_json(shape, c.logprobs)
        if shape.chat:
            message: dict = {"role": "assistant", "content": c.text}
            if c.tool_calls:
                message["content"] = c.text or None
                message["tool_calls"] = c.tool_calls
            out.append({"index": i, "message": message, "finish_reason": c.finish.value, "logprobs": lp})
        else:
            out.append({"index": i, "text": c.text, "finish_reason": c.finish.value, "logprobs": lp})
    return {"id": shape.id_prefix + rid, "object": shape.object, "created": int(time.time()),
            "model": model, "choices": out, "usage": usage_json(usage)}


def sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class ChunkWriter:
    """Builds the SSE events of one streamed response."""

    def __init__(self, shape: Shape, rid: str, model: str, include_usage: bool, logprobs: bool = False):
        self._shape = shape
        self._base = {"id": shape.id_prefix + rid, "object": shape.chunk_object,
                      "created": int(time.time()), "model": model}
        self._include_usage = include_usage
        self._logprobs = logprobs
        self._offsets: dict[int, int] = {}
        self._frames: dict[int, tuple[bytes, bytes]] = {}  # per choice: the bytes around a delta's text

    def _chunk(self, choice: dict) -> dict:
        out = dict(self._base, choices=[choice])
        if self._include_usage:
            out["usage"] = None
        return out

    def delta_sse(self, text: str, index: int = 0, logprobs: tuple[TokenLogprob, ...] = (),
                  tool_calls: tuple[ToolCall, ...] = ()) -> bytes:
        """``delta`` as one SSE event, byte for byte what encoding the dict gives; without
        logprobs or tool calls only the text is encoded, between bytes built once per choice."""
        if self._logprobs or tool_calls:
            return sse(self.delta(text, index, logprobs, tool_calls))
        frame = self._frames.get(index)
        if frame is None:
            probe = orjson.dumps(self.delta("\x00", index))  # the text's place, found by a marker
            head, _, tail = probe.rpartition(b'"\\u0000"')
            frame = self._frames[index] = (b"data: " + head, tail + b"\n\n")
        return frame[0] + orjson.dumps(text) + frame[1]

    def role(self, index: int = 0) -> dict | None:
        if not self._shape.chat:
            return None
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None, "logprobs": None})

    def delta(self, text: str, index: int = 0, logprobs: tuple[TokenLogprob, ...] = (),
              tool_calls: tuple[ToolCall, ...] = ()) -> dict:
        lp = None
        if self._logprobs:
            at = self._offsets.get(index, 0)
            lp = logprobs_json(self._shape, logprobs, at)
            self._offsets[index] = at + sum(len(t.token) for t in logprobs)
        if self._shape.chat:
            delta: dict = {"content": text}
            if tool_calls:
                delta = {"tool_calls": tool_call_deltas(tool_calls)} if not text else {
                    "content": text, "tool_calls": tool_call_deltas(tool_calls)}
            return self._chunk({"index": index, "delta": delta, "finish_reason": None, "logprobs": lp})
        return self._chunk({"index": index, "text": text, "finish_reason": None, "logprobs": lp})

    def finish(self, reason: FinishReason, index: int = 0) -> dict:
        if self._shape.chat:
            return self._chunk({"index": index, "delta": {}, "finish_reason": reason.value, "logprobs": None})
        return self._chunk({"index": index, "text": "", "finish_reason": reason.value, "logprobs": None})

    def usage(self, usage: Usage) -> dict | None:
        if not self._include_usage:
            return None
        return dict(self._base, choices=[], usage=usage_json(usage))


ERROR_TYPES = {**dict.fromkeys((400, 401, 404, 408), "invalid_request_error"), 403: "permission_error", 429:
               "rate_limit_error", 499: "cancelled", **dict.fromkeys((500, 503), "server_error"), 504: "timeout_error"}


def error_json(status: int, message: str, code: str | None, param: str | None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}

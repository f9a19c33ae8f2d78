"""OpenAI wire format: request bodies -> domain requests, domain results -> JSON.

Types are checked here (pydantic); value rules live in llmesh.validation so the
HTTP and gRPC fronts enforce the same ones."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from llmesh.errors import InvalidArgument
from llmesh.types import FinishReason, Message, Prompt, Sampling, Usage


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields are accepted and unused

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    n: int | None = None
    stream: bool | None = False

    class StreamOptions(BaseModel):
        include_usage: bool = False

    stream_options: StreamOptions | None = None

    def sampling(self, max_tokens: int | None) -> Sampling:
        if self.n not in (None, 1):
            raise InvalidArgument("Only n=1 is supported.", param="n")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return Sampling(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                        stop=stop, seed=self.seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _MessageIn(BaseModel):
    role: str
    content: str | list[_TextPart]

    def to_domain(self) -> Message:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return Message(role="system" if self.role == "developer" else self.role, content=content)


class ChatBody(_Body):
    messages: list[_MessageIn]
    max_completion_tokens: int | None = None

    def prompt(self) -> Prompt:
        return Prompt(messages=tuple(m.to_domain() for m in self.messages))

    def sampling_params(self) -> Sampling:
        return self.sampling(self.max_completion_tokens if self.max_completion_tokens is not None
                             else self.max_tokens)


class CompletionBody(_Body):
    prompt: str | list[str]

    def prompt_value(self) -> Prompt:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise InvalidArgument("Only one prompt per request is supported.", param="prompt")
            return Prompt(text=self.prompt[0])
        return Prompt(text=self.prompt)

    def sampling_params(self) -> Sampling:
        return self.sampling(self.max_tokens if self.max_tokens is not None else 16)


def parse(body_cls: type[_Body], raw: bytes) -> _Body:
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


def completion_json(shape: Shape, rid: str, model: str, text: str, finish: FinishReason,
                    usage: Usage) -> dict:
    if shape.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish.value, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish.value, "logprobs": None}
    return {"id": shape.id_prefix + rid, "object": shape.object, "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage_json(usage)}


class ChunkWriter:
    """Builds the SSE events of one streamed response."""

    def __init__(self, shape: Shape, rid: str, model: str, include_usage: bool):
        self._shape = shape
        self._base = {"id": shape.id_prefix + rid, "object": shape.chunk_object,
                      "created": int(time.time()), "model": model}
        self._include_usage = include_usage

    def _chunk(self, choice: dict) -> dict:
        out = dict(self._base, choices=[choice])
        if self._include_usage:
            out["usage"] = None
        return out

    def role(self) -> dict | None:
        if not self._shape.chat:
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None, "logprobs": None})

    def delta(self, text: str) -> dict:
        if self._shape.chat:
            return self._chunk({"index": 0, "delta": {"content": text}, "finish_reason": None, "logprobs": None})
        return self._chunk({"index": 0, "text": text, "finish_reason": None, "logprobs": None})

    def finish(self, reason: FinishReason) -> dict:
        if self._shape.chat:
            return self._chunk({"index": 0, "delta": {}, "finish_reason": reason.value, "logprobs": None})
        return self._chunk({"index": 0, "text": "", "finish_reason": reason.value, "logprobs": None})

    def usage(self, usage: Usage) -> dict | None:
        if not self._include_usage:
            return None
        return dict(self._base, choices=[], usage=usage_json(usage))


ERROR_TYPES = {400: "invalid_request_error", 408: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error", 404: "invalid_request_error", 429: "rate_limit_error",
               499: "cancelled", 500: "server_error", 503: "server_error", 504: "timeout_error"}


def error_json(status: int, message: str, code: str | None, param: str | None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}

"""Request rules that hold whatever the transport: the gateway checks them before
routing, the engine again before decoding (gRPC clients may call it directly)."""

from __future__ import annotations

import json

from llmesh.errors import InvalidArgument
from llmesh.types import Message, Prompt, ResponseFormat, Sampling

MAX_STOP_SEQUENCES = 4
# The wire types of SamplingParams (common.proto): max_tokens is a uint32, seed an int64.
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_MESSAGES = 2048  # OpenAI's own limit on a conversation's length
MAX_TOP_LOGPROBS = 20
RESPONSE_FORMATS = frozenset({"json_object", "json_schema"})
CHAT_ROLES = frozenset({"system", "user", "assistant"})


def check_sampling(s: Sampling) -> None:
    if s.max_tokens is not None and s.max_tokens < 1:
        raise InvalidArgument(f"max_tokens must be at least 1, got {s.max_tokens}.", param="max_tokens")
    if s.max_tokens is not None and s.max_tokens > UINT32_MAX:
        raise InvalidArgument(f"max_tokens must be at most {UINT32_MAX}, got {s.max_tokens}.", param="max_tokens")
    if s.seed is not None and not INT64_MIN <= s.seed <= INT64_MAX:
        raise InvalidArgument(f"seed must be between {INT64_MIN} and {INT64_MAX}, got {s.seed}.", param="seed")
    if s.temperature is not None and not 0.0 <= s.temperature <= 2.0:
        raise InvalidArgument(f"temperature must be between 0 and 2, got {s.temperature}.",
                              param="temperature")
    if s.top_p is not None and not 0.0 < s.top_p <= 1.0:
        raise InvalidArgument(f"top_p must be greater than 0 and at most 1, got {s.top_p}.", param="top_p")
    if len(s.stop) > MAX_STOP_SEQUENCES:
        raise InvalidArgument(f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(s.stop)}.",
                              param="stop")
    if any(not seq for seq in s.stop):
        raise InvalidArgument("stop sequences must not be empty.", param="stop")
    if s.logprobs is not None and not 0 <= s.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {s.logprobs}.",
                              param="top_logprobs")
    if s.response_format is not None:
        check_response_format(s.response_format)


def check_response_format(f: ResponseFormat) -> None:
    if f.type not in RESPONSE_FORMATS:
        raise InvalidArgument(f"response_format.type must be one of {sorted(RESPONSE_FORMATS)}, got '{f.type}'.",
                              param="response_format.type")
    if f.type != "json_schema":
        if f.schema is not None:
            raise InvalidArgument(f"response_format of type '{f.type}' takes no schema.",
                                  param="response_format")
        return
    if not f.schema:
        raise InvalidArgument("response_format json_schema needs a schema.", param="response_format.json_schema")
    try:
        schema = json.loads(f.schema)
    except ValueError:
        raise InvalidArgument("response_format.json_schema.schema is not valid JSON.",
                              param="response_format.json_schema.schema") from None
    if not isinstance(schema, dict):
        raise InvalidArgument("response_format.json_schema.schema must be a JSON object.",
                              param="response_format.json_schema.schema")


def check_messages(messages: tuple[Message, ...]) -> None:
    if not messages:
        raise InvalidArgument("messages must hold at least one message.", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"messages holds {len(messages)} messages; at most {MAX_MESSAGES} are allowed.",
                              param="messages")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got '{m.role}'.",
                                  param=f"messages[{i}].role")


def check_request(model: str, prompt: Prompt, sampling: Sampling) -> None:
    if not model:
        raise InvalidArgument("model is required.", param="model")
    if prompt.messages is not None:
        check_messages(prompt.messages)
    check_sampling(sampling)

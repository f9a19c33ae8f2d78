"""Request rules that hold whatever the transport: the gateway checks them before
routing, the engine again before decoding (gRPC clients may call it directly)."""

from __future__ import annotations

from llmesh.errors import InvalidArgument
from llmesh.types import Message, Prompt, Sampling

MAX_STOP_SEQUENCES = 4
# The wire types of SamplingParams (common.proto): max_tokens is a uint32, seed an int64.
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_MESSAGES = 2048  # OpenAI's own limit on a conversation's length
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

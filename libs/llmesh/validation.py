"""Request rules that hold whatever the transport: the gateway checks them before
routing, the engine again before decoding (gRPC clients may call it directly)."""

from __future__ import annotations

from llmesh.errors import InvalidArgument
from llmesh.types import Message, Prompt, Sampling

MAX_STOP_SEQUENCES = 4
CHAT_ROLES = frozenset({"system", "user", "assistant"})


def check_sampling(s: Sampling) -> None:
    if s.max_tokens is not None and s.max_tokens < 1:
        raise InvalidArgument(f"max_tokens must be at least 1, got {s.max_tokens}.", param="max_tokens")
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

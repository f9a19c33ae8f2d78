"""Tool calls out of an answer that the backend's grammar shaped (``llmesh.tool_prompt``'s
format): pure, no gRPC.

With ``tool_choice`` "required" or a named function the answer is one or more calls; with
"auto" it is either text, which never starts with "<", or calls, which always start with
``<tool_call>``: its first character decides. Text passes through as it comes; a call's text
is held until its ``</tool_call>``, then comes out as one whole ``ToolCall`` (a new id, the name,
the arguments as compact JSON text). The grammar makes every call parse; one that does not
(a backend that broke its contract) fails the request rather than reach the client."""

from __future__ import annotations

import json
import secrets

from llmesh.errors import Internal
from llmesh.tool_prompt import CALL_CLOSE, CALL_OPEN
from llmesh.types import Delta, FinishReason, ToolCall
from llmesh.engine.stops import StopMatcher


def call_id() -> str:
    """An id in OpenAI's shape: ``call_`` and 24 random characters."""
    return "call_" + secrets.token_hex(12)


class CallReader:
    """One answer's items through the tool-call format; ``feed`` each Delta, then ``reason``."""

    __slots__ = ("_mode", "_held", "_tokens", "_from", "_stops", "calls")

    def __init__(self, calls_only: bool, stops: tuple[str, ...] = ()):
        self._mode = "calls" if calls_only else ""  # "": not decided yet (auto), "text" or "calls"
        self._stops = StopMatcher(stops)  # applied to a text answer only: a call is whole or none
        self._held = ""      # text not given out yet
        self._tokens = 0     # the tokens behind it
        self._from = 0       # where to look for the next CALL_CLOSE in _held
        self.calls = 0       # calls given out so far

    def feed(self, delta: Delta) -> Delta | None:
        """What of ``delta`` goes out now: its text (auto's text answer), completed calls, or
        None while a call (or auto's first character) is still coming."""
        if self._mode == "text":
            return self._text(delta.text, delta.tokens, delta)
        self._held += delta.text
        self._tokens += delta.tokens
        if not self._mode:
            if not self._held:
                return None
            self._mode = "calls" if self._held.startswith("<") else "text"
            if self._mode == "text":
                text, tokens, self._held, self._tokens = self._held, self._tokens, "", 0
                return self._text(text, tokens, delta)
        return self._completed()

    def _text(self, text: str, tokens: int, delta: Delta) -> Delta | None:
        if self._stops.stopped:
            return None  # the answer ended at its stop string
        if self._stops.active:
            text = self._stops.feed(text)
        elif text is delta.text and tokens == delta.tokens:
            return delta
        return Delta(text, tokens, delta.logprobs) if text or tokens else None

    @property
    def stopped(self) -> bool:
        """A text answer met a stop string: the answer ends here."""
        return self._stops.stopped

    def flush(self) -> Delta | None:
        """A text answer's text held back for a stop string that did not come."""
        rest = self._stops.flush()
        return Delta(rest, 0) if rest else None

    def _completed(self) -> Delta | None:
        calls = []
        while (end := self._held.find(CALL_CLOSE, self._from)) >= 0:
            start = self._held.find(CALL_OPEN)
            calls.append(self._call(self._held[start + len(CALL_OPEN):end] if 0 <= start < end else ""))
            self._held = self._held[end + len(CALL_CLOSE):]
            self._from = 0
        if not calls:
            self._from = max(0, len(self._held) - len(CALL_CLOSE))
            return None
        tokens, self._tokens = self._tokens, 0
        return Delta("", tokens, tool_calls=tuple(calls))

    def _call(self, body: str) -> ToolCall:
        try:
            call = json.loads(body)
            name, arguments = call["name"], call["arguments"]
        except (ValueError, TypeError, KeyError):
            raise Internal("The model's tool call does not parse as the grammar should have made it.") from None
        index, self.calls = self.calls, self.calls + 1
        return ToolCall(index=index, id=call_id(), name=name,
                        arguments=json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))

    def reason(self, reason: FinishReason) -> FinishReason:
        """The answer's finish reason: ``tool_calls`` when it ended after its calls."""
        return FinishReason.TOOL_CALLS if self.calls and reason is FinishReason.STOP else reason

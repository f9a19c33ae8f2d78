"""Output filters: the answer's text rewritten as it streams, by the filters stages put
on the request (PII masking, then restoring), and the logprob gate behind them.

The gate: a token's text is released only once the client has been sent exactly that
text. While the filtered answer is the raw answer, entries pass unchanged as the text
they cover goes out; from the first rewrite on, entries go out with their token texts
(and the alternatives') blanked, keeping the numbers, so masked values never leak
through logprobs."""

from __future__ import annotations

from collections import deque

from llmesh.types import Delta, TokenLogprob
from llmesh.gateway.context import OutputFilter, WholeAnswer


def filtered(filters: list[OutputFilter], gate: LogprobGate | None, item: Delta) -> Delta:
    """A delta as the client gets it. An answer in one piece flushes the filters with it."""
    text, last = item.text, type(item) is WholeAnswer
    for f in filters:
        text = f.feed(text)
        if last:
            text += f.flush()
    return Delta(text=text, tokens=item.tokens, logprobs=gate.feed(item.text, item.logprobs, text) if gate else (),
                 tool_calls=item.tool_calls)  # their arguments are not rewritten


def tail(filters: list[OutputFilter], gate: LogprobGate | None) -> Delta | None:
    """What the filters (and the gate) still hold once the answer is over, if anything."""
    text = ""
    for f in filters:
        text = f.feed(text) + f.flush()
    rest = gate.feed("", (), text, last=True) if gate else ()
    return Delta(text=text, tokens=0, logprobs=rest) if text or rest else None


class LogprobGate:
    def __init__(self) -> None:
        self._raw: list[str] = []
        self._raw_len = 0
        self._sent: list[str] = []
        self._sent_len = 0
        self._pending: deque[tuple[int, TokenLogprob]] = deque()  # (raw end offset, entry)
        self.redacted = False

    def feed(self, raw: str, entries: tuple[TokenLogprob, ...], sent: str, last: bool = False
             ) -> tuple[TokenLogprob, ...]:
        """``raw`` and its ``entries`` came from the engine; ``sent`` is what the filters let
        out now. Returns the entries that may go out with ``sent``."""
        self._raw.append(raw)
        self._raw_len += len(raw)
        self._sent.append(sent)
        self._sent_len += len(sent)
        end = self._pending[-1][0] if self._pending else self._raw_len - len(raw)
        for e in entries:
            end += len(e.token)
            self._pending.append((end, e))
        if not self.redacted:
            raw_text, sent_text = "".join(self._raw), "".join(self._sent)
            self.redacted = sent_text != raw_text if last else not raw_text.startswith(sent_text)
        out = []
        while self._pending and (last or self.redacted or self._pending[0][0] <= self._sent_len):
            _, e = self._pending.popleft()
            out.append(_blank(e) if self.redacted else e)
        return tuple(out)


def _blank(e: TokenLogprob) -> TokenLogprob:
    return TokenLogprob("", e.logprob, tuple(("", lp) for _, lp in e.top))

"""The answer side of PII masking, for text that arrives as a stream of deltas.

- :class:`StreamMasker` masks PII that the model writes (the same rules as on the prompt). It holds
  back only what could still become part of a match: the trailing run of characters that can
  occur inside PII or at its edge (ASCII letters, digits, ``@._%+-:()/``), plus the number groups before it
  when it starts like a number (``+1 415 555 2671`` arrives in pieces), at most ``max_hold``
  characters. Whitespace, other punctuation and non-ASCII text (Chinese included) end a run, so
  prose and Chinese answers stream with at most one word held. That word cannot be given out
  sooner: by the e-mail rule every ASCII word may be the start of an address (``alpha`` then
  ``@example.com``), so releasing it would leak the local part. A run longer than ``max_hold`` is
  released masked as it stands; if a match ran to its end, the rest of that run is swallowed
  into the same placeholder. A PEM private key is replaced by one placeholder as soon as its
  ``-----BEGIN ... PRIVATE KEY-----`` line is complete, and everything up to its END line is
  dropped.
- :class:`StreamRestorer` puts a request's originals back into the answer, holding back only a
  trailing ``[``... that may still become a known placeholder.

Run the masker first and the restorer on its output: PII the model invents is masked, placeholders
it repeats from the prompt are restored. Share the request's :class:`Placeholders` with the masker
so that a value seen in the prompt keeps its placeholder, and numbers never collide. The restorer
copies the mapping it is given: build it from the prompt's mapping, so PII masked on the output
side is never restored.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping

from llmesh.gateway.domain.guards.pii import PiiMasker, Placeholders, restore
from llmesh.gateway.domain.guards.pii_rules import LABELS, PiiKind

# Characters a match of a rule (the PEM block aside) can hold, or that its boundary checks look at
# ("/" in ``2024/01``): a run of them at the end may still grow into PII, so it is held. "=" is in
# no rule, so it ends a run like a space: "x=" is released at once (tests derive this set from
# the rules' expressions).
_TOKEN_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789@._%+-:()/"
_NUMBERISH = re.compile(r"[+(]?[0-9][0-9().\-]*|[+(]", re.ASCII)
_NUMBERISH_TAIL = re.compile(r"(?:[+(]?[0-9][0-9().\-]*|[+(])\Z", re.ASCII)  # the longest such end of a run
_PEM_BEGIN = re.compile(r"-----BEGIN[A-Z0-9 ]{0,40}PRIVATE KEY-----")
_PEM_END = re.compile(r"-----END[A-Z0-9 ]{0,40}PRIVATE KEY-----")
_BEGIN = "-----BEGIN"
_PEM_HEADER_MAX = 80  # "-----BEGIN" + up to 40 characters + "PRIVATE KEY-----"
_LONGEST_PLACEHOLDER = len("[SECRET_]") + 12


class StreamMasker:
    """``feed(delta) -> str`` returns the masked text that is final; ``flush()`` the rest."""

    def __init__(self, masker: PiiMasker, placeholders: Placeholders | None = None, max_hold: int = 256):
        self._masker = masker
        self._placeholders = placeholders if placeholders is not None else Placeholders()
        self._max_hold = max_hold
        self._keys = PiiKind.SECRET in masker.kinds
        self.counts: Counter[str] = Counter()
        self._buf = ""
        self._key: str | None = None  # placeholder of a private key whose END has not come yet
        self._glued: str | None = None  # placeholder of a match whose run was cut at max_hold
        self._glued_grows = False

    @property
    def found(self) -> Mapping[str, str]:
        return self._placeholders.found

    def feed(self, delta: str) -> str:
        buf = self._buf + delta if self._buf else delta
        out: list[str] = []
        while buf:
            if self._key is not None:
                end = _PEM_END.search(buf)
                if end is None:  # drop the key's body, keep what may be the start of its END line
                    keep = max(0, len(buf) - _PEM_HEADER_MAX)
                    self._placeholders.extend(self._key, buf[:keep])
                    buf = buf[keep:]
                    break
                self._placeholders.extend(self._key, buf[:end.end()])
                self._key = None
                buf = buf[end.end():]
                continue
            if self._glued is not None:
                buf = self._swallow_glued(self._glued, buf)
                continue
            header = _PEM_BEGIN.search(buf) if self._keys and _BEGIN in buf else None
            if header is not None:
                out.append(self._release(buf[:header.start()]))
                self._key = self._placeholders.new(PiiKind.SECRET, header.group())
                self.counts[PiiKind.SECRET.value] += 1
                out.append(self._key)
                buf = buf[header.end():]
                continue
            cut = self._safe_cut(buf)
            forced = len(buf) - cut > self._max_hold
            if forced:
                cut = len(buf)
            out.append(self._release(buf[:cut], glue=forced))
            buf = buf[cut:]
            break
        self._buf = buf
        return "".join(out)

    def flush(self) -> str:
        buf, self._buf = self._buf, ""
        if self._key is not None:
            self._placeholders.extend(self._key, buf)
            self._key = None
            return ""
        if self._glued is not None:
            buf = self._swallow_glued(self._glued, buf)
            self._glued = None
        return self._release(buf)

    def _release(self, text: str, glue: bool = False) -> str:
        if not text:
            return ""
        known = set(self._placeholders.found) if glue else ()
        masked, last = self._masker.mask_part(text, self._placeholders, self.counts)
        if glue:  # a placeholder from before stands for its own value: only a new one grows
            self._glued = last
            self._glued_grows = last not in known
        return masked

    def _swallow_glued(self, glued: str, buf: str) -> str:
        i = len(buf) - len(buf.lstrip(_TOKEN_CHARS))
        if self._glued_grows:
            self._placeholders.extend(glued, buf[:i])
        if i < len(buf):
            self._glued = None
        return buf[i:]

    def _safe_cut(self, buf: str) -> int:
        """Where the held tail starts: nothing before it can change with more text."""
        i = len(buf.rstrip(_TOKEN_CHARS))
        if i < len(buf) and not _NUMBERISH.match(buf, i):  # a run that starts like a number may join
            return self._pem_cut(buf, i)                     # the number groups before it
        while i > 1 and buf[i - 1] == " ":  # number groups: +1 415 555 ...
            s = len(buf[:i - 1].rstrip(_TOKEN_CHARS))
            # A number that may start in the run before ("(+1", "tel:+1", "2001" of an address) and go on
            # into the held text holds that run whole; a run that starts like a number may itself continue
            # one from the groups before it.
            if s == i - 1 or _NUMBERISH_TAIL.search(buf, s, i - 1) is None:
                break
            i = s
            if not _NUMBERISH.match(buf, s):
                break
        return self._pem_cut(buf, i)

    def _pem_cut(self, buf: str, cut: int) -> int:
        """Holds an unfinished ``-----BEGIN ...`` line (it has spaces, so the run above misses it)."""
        if not self._keys or "-" not in buf[-_PEM_HEADER_MAX:]:
            return cut
        at = buf.rfind(_BEGIN, max(0, len(buf) - _PEM_HEADER_MAX))
        if at != -1 and "-----" not in buf[at + len(_BEGIN):]:
            return min(cut, at)
        for k in range(len(_BEGIN) - 1, 0, -1):
            if buf.endswith(_BEGIN[:k]):
                return min(cut, len(buf) - k)
        return cut


class StreamRestorer:
    """``feed(delta) -> str`` returns restored text that is final; ``flush()`` the rest."""

    def __init__(self, mapping: Mapping[str, str]):
        self._mapping = dict(mapping)
        self._labels = tuple({p[1:p.rindex("_")] for p in self._mapping} & set(LABELS.values()))
        self._held = ""

    def feed(self, delta: str) -> str:
        if not self._mapping:
            return delta
        text = self._held + delta if self._held else delta
        cut = self._partial_start(text)
        self._held = text[cut:]
        return restore(text[:cut], self._mapping)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_start(self, text: str) -> int:
        at = text.rfind("[", max(0, len(text) - _LONGEST_PLACEHOLDER))
        if at == -1 or "]" in text[at:]:
            return len(text)
        label, sep, number = text[at + 1:].partition("_")
        if sep:
            maybe = label in self._labels and (not number or number.isdigit())
        else:
            maybe = any(known.startswith(label) for known in self._labels)
        return at if maybe else len(text)

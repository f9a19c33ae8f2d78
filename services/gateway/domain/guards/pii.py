"""PII masking: personal data in a prompt becomes a placeholder such as ``[EMAIL_1]``
before the prompt leaves the gateway, and can be put back into the answer.

Kinds (``PiiMasker(kinds)`` enables any subset):

- ``email``       local@domain.tld (ASCII).
- ``phone``       international (``+`` or ``00``, country code, 8-15 digits in all), Chinese
                  mobiles ``1[3-9]`` + 9 digits (optional ``+86``/``0086``, spaces or dashes as
                  3-4-4), Chinese landlines ``0AA(A)-NNNNNNN(N)``, North American numbers written
                  with separators (``(415) 555-2671``, ``415.555.2671``; area code and exchange
                  start with 2-9). A bare run of digits is a phone only as a Chinese mobile.
- ``national_id`` the Chinese resident ID (18 characters: region 1-8xxxxx, a real birth date,
                  the ISO 7064 MOD 11-2 check digit) and the US SSN written ``AAA-GG-SSSS`` (area
                  000, 666, 900-999, group 00 and serial 0000 are never issued, so not matched).
- ``bank_card``   13-19 digits, bare or in groups of four (Amex 4-6-5) with one kind of separator,
                  starting with a major network's prefix (Visa, Mastercard, Amex, Discover, JCB,
                  Diners, UnionPay, Maestro, Mir) and passing the Luhn check.
- ``ip``          IPv4 and IPv6 addresses that Python's ``ipaddress`` accepts. A bare dotted quad
                  such as ``1.2.3.4`` is a valid address, so it is masked even if it was meant as a
                  version (leaking an address is worse than hiding a version); ``v1.2.3.4``,
                  ``1.2.3.4.5`` and ``999.1.1.1`` are not addresses and stay.
- ``secret``      API keys with well-known prefixes (OpenAI/Anthropic ``sk-``, Stripe ``sk_live_``,
                  AWS ``AKIA``/``ASIA``, GitHub ``ghp_``/``github_pat_``, GitLab ``glpat-``, Slack
                  ``xox?-``, Google ``AIza``, Hugging Face ``hf_``), JWTs (the header must decode to a
                  JSON object) and PEM private-key blocks.

Numbers are matched whole: digits glued to letters, or continuing with ``.``/``-``/``/`` and a
digit (versions, dates, longer numbers), are not a match. The rules are only tried where a match
can begin (see ``_NUMBER_START`` and friends below), found by one C-level regex pass plus a few
``str.find`` calls, so text without candidates costs about one pass; the number rules are tried
together as one combined expression, and a candidate that fails its check (date, check digit,
Luhn, address) is offered to the other rules at the same place before the scan moves on.

Placeholders are ``[LABEL_n]`` with LABEL one of EMAIL PHONE ID CARD IP SECRET, numbered per
label. Within one :class:`Placeholders` (one request) the same value always gets the same
placeholder (values compare normalised: e-mail case-folded, numbers without separators,
addresses canonical); the mapping keeps the first spelling seen. Placeholder-shaped text already
in the input keeps its number out of use, so restoring never rewrites what the user typed.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import cast

from llmesh.types import Message, Tools
from llmesh.gateway.domain.guards.pii_json import mask_json_text, mask_schema_text
from llmesh.gateway.domain.guards.pii_rules import (_AFTER_PHONE, _CHECKS, _RULES, LABELS, PEM_BEGIN, PEM_END,
                                                    PLACEHOLDER, PiiKind)


class Placeholders:
    """One request's placeholders: value -> ``[LABEL_n]`` and back. Shared by every message of a
    chat (and by the answer's stream masker) so the same value gets the same placeholder. Whoever
    makes one calls :meth:`reserve` with the request's texts first (``mask`` and ``mask_messages``
    do when they make their own)."""

    def __init__(self, reserved: Iterable[str] = ()):
        self.found: dict[str, str] = {}  # placeholder -> original text
        self._by_value: dict[tuple[str, str], str] = {}
        self._next: Counter[str] = Counter()
        self._reserved = set(reserved)

    def copy(self) -> Placeholders:
        """An independent copy: each choice of a request (``n`` > 1) masks its own answer, starting
        from the prompt's placeholders."""
        other = Placeholders(self._reserved)
        other.found = dict(self.found)
        other._by_value = dict(self._by_value)
        other._next = Counter(self._next)
        return other

    def reserve(self, texts: Iterable[str]) -> None:
        """Keeps placeholder-shaped text already present in ``texts`` from being handed out."""
        for text in texts:
            if "[" in text:
                self._reserved.update(PLACEHOLDER.findall(text))

    def assign(self, kind: PiiKind, value: str, original: str) -> str:
        key = (kind.value, value)
        placeholder = self._by_value.get(key)
        if placeholder is None:
            placeholder = self.new(kind, original)
            self._by_value[key] = placeholder
        return placeholder

    def new(self, kind: PiiKind, original: str) -> str:
        label = LABELS[kind]
        while True:
            self._next[label] += 1
            placeholder = f"[{label}_{self._next[label]}]"
            if placeholder not in self._reserved:
                break
        self.found[placeholder] = original
        return placeholder

    def extend(self, placeholder: str, more: str) -> None:
        """A streamed value grew after its placeholder went out (a private key, a cut token)."""
        self.found[placeholder] += more


@dataclass(frozen=True, slots=True)
class Masked:
    text: str
    found: Mapping[str, str]  # placeholder -> original, for restore() and StreamRestorer
    counts: Mapping[str, int]  # kind -> occurrences masked
    placeholders: Placeholders  # the request's registry, for the answer's StreamMasker


@dataclass(frozen=True, slots=True)
class MaskedChat:
    messages: tuple[Message, ...]
    found: Mapping[str, str]
    counts: Mapping[str, int]
    placeholders: Placeholders


@dataclass(frozen=True, slots=True)
class Hit:
    start: int
    end: int
    kind: PiiKind
    value: str  # normalised


# Where a scan tries the rules: a number starts at a digit, "+" or "(" that no word character
# precedes and that six more number-like characters follow (the shortest, 1.2.3.4, has seven);
# an IPv6 address around a colon with a hex digit or colon after it; an e-mail around its "@";
# a secret at its literal prefix. Everything else is skipped by one C-level search or str.find,
# so prose costs about one regex pass and only candidates pay for the rules.
_NUMBER_START = re.compile(r"[0-9+(](?<![A-Za-z0-9_@+].)(?=[0-9.\-() ]{6})", re.ASCII)
_HEX_COLON = "0123456789abcdefABCDEF:"
_LOCAL = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.%+-"
_RUNS = {chars: re.compile(f"[{re.escape(chars)}]*") for chars in (_HEX_COLON, _LOCAL)}
# Secret prefixes, grouped under a character each group needs (one memchr says whether to look).
_SECRET_PREFIXES = (("-", ("sk-", "glpat-", "xox")),
                    ("_", ("sk_", "rk_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "hf_")),
                    ("A", ("AKIA", "ASIA", "AIza")),
                    ("J", ("eyJ",)))
_PEM_PREFIX = "-----BEGIN"
_PEM_BEGIN = re.compile(PEM_BEGIN)
_PEM_END = re.compile(PEM_END)
_NOT_NUMERIC = (PiiKind.SECRET, PiiKind.EMAIL)
# Every match holds one of these: a digit, "@", ":" (IPv6), or a character of every secret prefix.
_MAYBE_PII = re.compile(r"[0-9@:\-_AJ]")


class PiiMasker:
    """Finds and masks the enabled kinds. Immutable after construction; share one instance."""

    def __init__(self, kinds: Iterable[PiiKind | str] = tuple(PiiKind)):
        self.kinds = frozenset(PiiKind(k) for k in kinds)
        rules = [(name, kind, pattern) for name, kind, pattern in _RULES if kind in self.kinds]
        self._kind_of = {name: kind for name, kind, _ in rules}
        self._single = {name: re.compile(pattern, re.ASCII) for name, _, pattern in rules}
        numeric = [(n, p) for n, k, p in rules if k not in _NOT_NUMERIC and n != "ipv6"]
        self._numeric_names = [n for n, _ in numeric]
        self._numeric = re.compile("|".join(f"(?P<{n}>{p})" for n, p in numeric), re.ASCII) if numeric else None
        secret = [(n, p) for n, k, p in rules if k is PiiKind.SECRET and n != "pem_key"]
        self._secret = re.compile("|".join(f"(?P<{n}>{p})" for n, p in secret), re.ASCII) if secret else None
        self._pem = PiiKind.SECRET in self.kinds

    def scan(self, text: str) -> list[Hit]:
        """Every accepted match, left to right. Matches that overlap (a phone number running into an
        IPv6 address) become one hit over their union, of the longer one's kind: nothing of
        either is left in the clear."""
        hits: list[Hit] = []
        if self._numeric is not None:
            self._scan_numbers(self._numeric, text, hits)
        if "ipv6" in self._single and ":" in text:
            self._scan_around(text, ":", _HEX_COLON, 39, "ipv6", hits)
        if "email" in self._single and "@" in text:
            self._scan_around(text, "@", _LOCAL, 64, "email", hits)
        if self._pem and _PEM_PREFIX in text:
            self._scan_pem(text, hits)
        if self._secret is not None:
            self._scan_secrets(self._secret, text, hits)
        if len(hits) < 2:
            return hits
        hits.sort(key=lambda h: (h.start, -h.end))
        kept = [hits[0]]
        for hit in hits[1:]:
            last = kept[-1]
            if hit.start >= last.end:
                kept.append(hit)
            elif hit.end > last.end:
                longer = hit if hit.end - hit.start > last.end - last.start else last
                kept[-1] = Hit(last.start, hit.end, longer.kind, text[last.start:hit.end])
        return kept

    def _scan_numbers(self, numeric: re.Pattern[str], text: str, hits: list[Hit]) -> None:
        match, search = numeric.match, _NUMBER_START.search
        pos = 0
        while (t := search(text, pos)) is not None:
            at = t.start()
            hit = None
            if (m := match(text, at)) is not None:
                rule = cast(str, m.lastgroup)  # a combined pattern's match is one rule's named group
                hit = self._accept(rule, at, m.end(), text) or self._other_rule(numeric, rule, at, text)
            if hit is None:
                pos = at + 1
                continue
            hits.append(hit)
            pos = hit.end

    def _scan_around(self, text: str, anchor: str, chars: str, reach: int, rule: str, hits: list[Hit]) -> None:
        """Tries ``rule`` once per run of ``chars`` that holds an ``anchor``, from the run's start
        (a run reaching further than ``reach`` before the anchor cannot start a match)."""
        run = _RUNS[chars]
        done = 0
        at = text.find(anchor)
        while at != -1:
            if at + 1 < len(text) and text[at + 1] in chars:
                window = max(0, at - reach - 1)
                start = window + len(text[window:at].rstrip(chars))
                hit = self._try(rule, start, text) if start > window or window == 0 else None
                if hit is None and rule == "ipv6" and at and text[at - 1].isalpha():
                    hit = self._try(rule, at + 1, text)  # "IP:2001:db8::1", "note:fe80::1"
                # later anchors in this run start at the same place (a run, maybe empty, always matches)
                done = cast("re.Match[str]", run.match(text, at + 1)).end()
                if hit is not None:
                    hits.append(hit)
                    done = max(done, hit.end)
            at = text.find(anchor, max(at + 1, done))

    @staticmethod
    def _scan_pem(text: str, hits: list[Hit]) -> None:
        """Private-key blocks: a BEGIN line, then everything up to the first END line after it (or
        the end of the text). The scan goes on after the block, so each character is read once:
        a BEGIN line inside a block is part of it (once, a lazy ``[\\s\\S]*?`` was retried from
        every BEGIN line and each block copied to the end: 100 KB of headers took 7.5 s)."""
        pos = 0
        while (header := _PEM_BEGIN.search(text, pos)) is not None:
            end = _PEM_END.search(text, header.end())
            stop = len(text) if end is None else end.end()
            hits.append(Hit(header.start(), stop, PiiKind.SECRET, text[header.start():stop]))
            pos = stop

    def _scan_secrets(self, secret: re.Pattern[str], text: str, hits: list[Hit]) -> None:
        """Keys and tokens at their literal prefixes. Each rule starts after a character that
        cannot be inside a key (a look-behind), so a prefix inside a key fails at once, and a
        match ends at the end of its run: every character is read a bounded number of times."""
        match = secret.match
        for needed, prefixes in _SECRET_PREFIXES:
            if needed not in text:
                continue
            for prefix in prefixes:
                at = text.find(prefix)
                while at != -1:
                    if (m := match(text, at)) is not None and (hit := self._accept(cast(str, m.lastgroup), at,
                                                                                   m.end(), text)):
                        hits.append(hit)
                        at = text.find(prefix, hit.end)
                    else:
                        at = text.find(prefix, at + 1)

    def _try(self, name: str, at: int, text: str) -> Hit | None:
        m = self._single[name].match(text, at)
        return None if m is None else self._accept(name, at, m.end(), text)

    def _accept(self, name: str, start: int, end: int, text: str) -> Hit | None:
        value = _CHECKS[name](text[start:end])
        return None if value is None else Hit(start, end, self._kind_of[name], value)

    def _other_rule(self, numeric: re.Pattern[str], failed: str, at: int, text: str) -> Hit | None:
        for name in self._numeric_names:
            if name != failed and (hit := self._try(name, at, text)) is not None:
                return hit
        return self._shorter_phone(numeric, at, text)

    def _shorter_phone(self, numeric: re.Pattern[str], at: int, text: str) -> Hit | None:
        """A phone number starting at ``at`` that ends sooner than the rule's match. The
        international form's groups are greedy and may swallow the number after it
        ("+1 (200) 200-0000 13000000000" matches whole: too many digits for a phone), and
        re does not backtrack into a match its check refused. So every shorter end with the
        rule's own boundary after it is tried: the longest that leaves a number the scan
        recognises right after it, else the longest."""
        phone = self._single.get("phone")
        if phone is None or (m := phone.match(text, at)) is None:
            return None
        found = None
        for end in range(m.end() - 1, at + 1, -1):
            if not (text[end - 1].isdigit() or text[end - 1] == ")") or not phone.fullmatch(text, at, end) \
                    or not _AFTER_PHONE.match(text, end) or (hit := self._accept("phone", at, end, text)) is None:
                continue
            found = found or hit
            nxt = end + 1 if text[end:end + 1] in (" ", ".", "-") else end
            if (n := numeric.match(text, nxt)) is not None and self._accept(cast(str, n.lastgroup), nxt, n.end(), text):
                return hit
        return found

    def mask(self, text: str, placeholders: Placeholders | None = None) -> Masked:
        if placeholders is None:
            placeholders = Placeholders()
            placeholders.reserve((text,))
        counts: Counter[str] = Counter()
        masked, _ = self.mask_part(text, placeholders, counts)
        return Masked(masked, dict(placeholders.found), counts, placeholders)

    def mask_messages(self, messages: Sequence[Message], placeholders: Placeholders | None = None,
                      counts: Counter[str] | None = None) -> MaskedChat:
        """Masks every message with one shared mapping; roles and call ids are kept. A tool's answer
        and the arguments of the calls an assistant made are JSON: they are masked value by value and
        stay JSON (``pii_json``); a tool's answer that is not JSON is masked as text."""
        if placeholders is None:
            placeholders = Placeholders()
            placeholders.reserve(chat_texts(messages))
        counts = Counter() if counts is None else counts
        out = tuple(self._mask_message(m, placeholders, counts) for m in messages)
        return MaskedChat(out, dict(placeholders.found), counts, placeholders)

    def mask_part(self, text: str, placeholders: Placeholders, counts: Counter[str]) -> tuple[str, str | None]:
        """Masks ``text`` into ``placeholders`` and ``counts``. Also returns the placeholder of a
        match that runs to the very end of ``text`` (None if none), which a stream may continue."""
        if _MAYBE_PII.search(text) is None:
            return text, None
        parts: list[str] = []
        last, placeholder = 0, None
        for hit in self.scan(text):
            parts.append(text[last:hit.start])
            placeholder = placeholders.assign(hit.kind, hit.value, text[hit.start:hit.end])
            parts.append(placeholder)
            counts[hit.kind.value] += 1
            last = hit.end
        if not parts:
            return text, None
        parts.append(text[last:])
        return "".join(parts), placeholder if last == len(text) else None

    def _mask_message(self, m: Message, placeholders: Placeholders, counts: Counter[str]) -> Message:
        if not m.tool_calls and m.role != "tool":  # prose only: the common case, kept short
            if not m.content or (masked := self.mask_part(m.content, placeholders, counts)[0]) is m.content:
                return m
            return replace(m, content=masked)

        def mask(text: str) -> str:
            return self.mask_part(text, placeholders, counts)[0]

        content = _mask_json(m.content, mask) if m.role == "tool" else mask(m.content) if m.content else m.content
        calls = m.tool_calls
        if calls:
            calls = tuple(c if (a := _mask_json(c.arguments, mask)) is c.arguments else replace(c, arguments=a)
                          for c in calls)
            calls = m.tool_calls if all(a is b for a, b in zip(calls, m.tool_calls)) else calls
        return m if content is m.content and calls is m.tool_calls else replace(m, content=content, tool_calls=calls)

    def mask_tools(self, tools: Tools, placeholders: Placeholders, counts: Counter[str]) -> Tools:
        """The functions' descriptions, and their parameter schemas' descriptions, titles, examples
        and enum/const/default values, masked into the request's ``placeholders`` (the schema stays
        JSON; names, types and patterns are kept)."""
        def mask(text: str) -> str:
            return self.mask_part(text, placeholders, counts)[0]

        functions = []
        for f in tools.functions:
            description, parameters = mask(f.description), _mask_json(f.parameters, mask, schema=True)
            functions.append(f if description is f.description and parameters is f.parameters
                             else replace(f, description=description, parameters=parameters))
        return tools if all(a is b for a, b in zip(functions, tools.functions)) else replace(tools,
                                                                                          functions=tuple(functions))


def _mask_json(text: str, mask: Callable[[str], str], schema: bool = False) -> str:
    """JSON text masked so that it stays JSON; text that is not JSON is masked as prose."""
    if not text or _MAYBE_PII.search(text) is None:
        return text
    masked = mask_schema_text(text, mask) if schema else mask_json_text(text, mask)
    return mask(text) if masked is None else masked


def chat_texts(messages: Sequence[Message]) -> Iterator[str]:
    """Every text of a chat that masking reads: contents and tool-call arguments."""
    for m in messages:
        yield m.content
        for call in m.tool_calls:
            yield call.arguments


def tools_texts(tools: Tools | None) -> Iterator[str]:
    """Every text of a request's tools that masking reads."""
    for f in tools.functions if tools is not None else ():
        yield f.description
        yield f.parameters


def restore(text: str, mapping: Mapping[str, str]) -> str:
    """Puts the originals back for every placeholder in ``mapping``; other text is untouched."""
    if not mapping or "[" not in text:
        return text
    return PLACEHOLDER.sub(lambda m: mapping.get(m[0], m[0]), text)

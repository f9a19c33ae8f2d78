"""A request's guard work as one plain function of plain values: the injection screen and the
PII masking of its prompt and of the tools it offers (``GuardJob`` in, ``GuardResult`` out).
Plain values can be pickled, so the same work runs inline for a small prompt and in a worker
process for a large one (``llmesh.gateway.guard_workers``), and the choices of one request
(``n`` > 1) share one run.

``light(job)`` says whether a job's work is small enough to run on the event loop: a few
hundred microseconds at most, whatever the text. Measured here (one core, ``bench.hostile``):
benign prose costs ~0.05 us a character to screen and mask; the worst inputs (a digit, ``@``
or ``:`` every other character, each one a place a PII rule must be tried) ~1.5 us. So a
prompt runs inline when it is at most ``INLINE_CHARS`` characters and holds at most
``INLINE_CANDIDATES`` of those characters (counted only for prompts that short)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from llmesh.types import Prompt, Tools
from llmesh.gateway.domain.guards.injection import InjectionScreen, Verdict
from llmesh.gateway.domain.guards.pii import PiiMasker, Placeholders, chat_texts, tools_texts

INLINE_CHARS = 4096
INLINE_CANDIDATES = 128
_CANDIDATES = "0123456789@:-_AJ"  # where PII rules are tried (pii._MAYBE_PII)
# The worst costs measured (bench.hostile's shapes, one core): per character read, per place a PII
# rule is tried. An upper bound on a job's time, within about 2x.
WORST_S_PER_CHAR = 0.05e-6
WORST_S_PER_CANDIDATE = 2.5e-6


@dataclass(frozen=True, slots=True)
class GuardJob:
    """What to do with one prompt: screen it (``threshold`` set) and/or mask its PII (``kinds``)."""
    prompt: Prompt
    threshold: float | None = None  # the injection screen's; None: no screen
    kinds: tuple[str, ...] | None = None  # PII kinds to mask; None: no masking
    max_chars: int = 128 * 1024  # the screen's caps (InjectionScreen)
    max_total_chars: int = 512 * 1024
    tools: Tools | None = None  # the functions the request offers: masked with the prompt (descriptions, schemas)


@dataclass(frozen=True, slots=True)
class GuardResult:
    verdict: Verdict | None
    prompt: Prompt | None  # masked; None when nothing was (a worker then sends no copy of it back)
    counts: dict[str, int] = field(default_factory=dict)  # kind -> occurrences masked
    found: dict[str, str] = field(default_factory=dict)  # placeholder -> original
    placeholders: Placeholders | None = None
    tools: Tools | None = None  # masked; None when nothing in them was


def texts(prompt: Prompt, tools: Tools | None = None) -> list[str]:
    """What masking reads: the contents, tool-call arguments and the offered tools' text."""
    if prompt.messages is None:
        return [prompt.text or ""]
    return [*chat_texts(prompt.messages), *tools_texts(tools)]


def worst_seconds(job: GuardJob) -> float:
    """About the longest the job can take, from a few C-speed passes over the text (a 16 MiB prompt:
    ~0.1 s). A job that could not finish within its deadline by this bound is refused at once
    rather than tried for the whole deadline."""
    parts = texts(job.prompt, job.tools)
    candidates = sum(t.count(c) for t in parts for c in _CANDIDATES)
    return sum(map(len, parts)) * WORST_S_PER_CHAR + candidates * WORST_S_PER_CANDIDATE


def light(job: GuardJob) -> bool:
    """The job is cheap enough for the event loop (see the module's note)."""
    parts = texts(job.prompt, job.tools)
    if sum(map(len, parts)) > INLINE_CHARS:
        return False
    return sum(t.count(c) for t in parts for c in _CANDIDATES) <= INLINE_CANDIDATES


def run(job: GuardJob, screen: InjectionScreen | None = None, masker: PiiMasker | None = None) -> GuardResult:
    """The job's work. ``screen`` and ``masker`` are the caller's shared instances when it has
    them (they must match the job's settings); else they are built from the job."""
    prompt = job.prompt
    verdict = None
    if job.threshold is not None:
        screen = screen or InjectionScreen(threshold=job.threshold, action="flag", max_chars=job.max_chars,
                                           max_total_chars=job.max_total_chars)
        verdict = screen.check(prompt.messages) if prompt.messages is not None else screen.check_text(prompt.text or "")
    if job.kinds is None:
        return GuardResult(verdict, None)
    masker = masker or PiiMasker(job.kinds)
    if prompt.messages is not None:
        placeholders, counts = Placeholders(), Counter[str]()
        placeholders.reserve(texts(prompt, job.tools))
        chat = masker.mask_messages(prompt.messages, placeholders, counts)
        masked_prompt = Prompt(messages=chat.messages) if chat.counts else None
        tools = masker.mask_tools(job.tools, placeholders, counts) if job.tools is not None else None
        return GuardResult(verdict, masked_prompt, dict(counts), dict(placeholders.found), placeholders,
                           tools if tools is not job.tools else None)
    masked = masker.mask(prompt.text or "")
    masked_prompt = Prompt(text=masked.text) if masked.counts else None
    return GuardResult(verdict, masked_prompt, dict(masked.counts), dict(masked.found), masked.placeholders)


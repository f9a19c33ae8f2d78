"""The field's routing workloads, generated from a seed (no downloaded data), scaled to a
fleet of sim engines. Each is a set of sessions; a session is a list of turns, each turn the
messages it adds to the session's history and the answer length it asks for (the answer
joins the history, as a chat client sends it back).

- ``shared_prefix``: a SaaS fleet: groups of single-turn prompts over their group's long
  system prompt (llm-d's shared-prefix shape).
- ``code_gen``: prefill-heavy: a long repository context shared by the requests on that
  repository, a file of their own, a short answer.
- ``reasoning``: decode-heavy: a short prompt over a short shared instruction, a long answer.
- ``zero_reuse``: the control: every prompt its own, nothing to gain from a cache.
- ``agentic``: multi-turn agents: a long tool-laden system prompt per agent kind, then turns
  that each add a tool's output; most of each turn's input is the previous turn's context.

Two more, not in the default run (``--workloads`` names them), each the field's own generator:
- ``shared_prefix_llmd``: llm-d's shared-prefix benchmark (inference-perf's ``shared_prefix`` data,
  its X-70R report: 150 groups of 5 prompts, 6,000-token system prompts, 1,200-token questions,
  1,000-token answers, 8 pods of 307,328 KV tokens) scaled by KV room to 4 engines of 65,536: half
  the groups, every length x 0.213. As inference-perf does, each group's questions are a fixed pool
  and the whole set of prompts repeats, in one shuffled order.
- ``agentic_replay``: ``agentic`` plus each session's own system prompt appended to the shared one
  (inference-perf's ``conversation_replay``: 8,359 shared and ~14,000 per-conversation tokens, which
  the shared 1,500 words scale to 2,500), the rest as ``agentic``.

Arrivals: ``open`` starts sessions by a Poisson process at a rate (a session's later turns
follow its answers after a think time); ``closed`` keeps a fixed number of users, each
starting its next session when the last ends."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from llmesh.types import Message


@dataclass(frozen=True, slots=True)
class Turn:
    messages: tuple[Message, ...]  # added to the session's history, then sent whole
    max_tokens: int                # the answer it asks for


@dataclass(frozen=True, slots=True)
class Shape:
    """A workload's sizes (words: one sim token each)."""
    name: str
    groups: int          # shared prefixes (system prompts, repositories, agent kinds)
    prefix_words: int    # words in each shared prefix (0: nothing shared)
    own_words: int       # words of each request's own part
    answer_tokens: int
    turns: tuple[int, int] = (1, 1)  # turns per session, lowest and highest
    think_s: float = 0.5             # between a session's turns (a tool's run, a user's reading)
    prompts_per_group: int = 0       # > 0: a fixed pool of this many own parts a group, all prompts cycled
    session_words: int = 0           # each session's own system prompt, after the shared one
    # a run's window, in Setup.duration_s: sessions are counted over its second half, which must hold
    # whole ones (an agent's session at saturation lasts up to ~30 s) or fewer end there than start
    window: float = 1.0


_AGENTIC = Shape("agentic", groups=4, prefix_words=1500, own_words=300, answer_tokens=64, turns=(4, 8), think_s=0.3,
                  window=2.0)
SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("shared_prefix", groups=48, prefix_words=1500, own_words=60, answer_tokens=48),
    Shape("code_gen", groups=24, prefix_words=3000, own_words=400, answer_tokens=64),
    Shape("reasoning", groups=4, prefix_words=120, own_words=80, answer_tokens=384),
    Shape("zero_reuse", groups=0, prefix_words=0, own_words=1200, answer_tokens=48),
    _AGENTIC,
    Shape("shared_prefix_llmd", groups=75, prefix_words=1280, own_words=256, answer_tokens=213, prompts_per_group=5),
    replace(_AGENTIC, name="agentic_replay", session_words=2500),
)}
WORKLOADS = ("shared_prefix", "code_gen", "reasoning", "zero_reuse", "agentic")  # the default run


def words(rng: random.Random, tag: str, n: int) -> str:
    return " ".join(f"{tag}{rng.randrange(5000)}" for _ in range(n))


class Sessions:
    """The sessions of one workload, fixed by the seed so every policy sees the same ones.
    ``scale`` shrinks every size (tests, ``--quick``)."""

    def __init__(self, shape: Shape | str, seed: int = 7, scale: float = 1.0):
        self.shape = SHAPES[shape] if isinstance(shape, str) else shape
        self.seed = seed
        self._scale = scale
        rng = random.Random(f"{self.shape.name}/{seed}")
        self.prefixes = [words(rng, f"g{g}p", self._n(self.shape.prefix_words)) for g in range(self.shape.groups)]
        self.pool = [(g, words(rng, f"g{g}q{k}", self._n(self.shape.own_words)))
                     for g in range(self.shape.groups) for k in range(self.shape.prompts_per_group)]
        rng.shuffle(self.pool)  # inference-perf shuffles its prompts once, then sends them in turn

    @property
    def name(self) -> str:
        return self.shape.name

    @property
    def think_s(self) -> float:
        return self.shape.think_s

    @property
    def window(self) -> float:
        return self.shape.window

    def _n(self, n: int) -> int:
        return max(int(n * self._scale), 1) if n else 0

    def session(self, n: int) -> list[Turn]:
        """Session ``n``'s turns: its first names the shared prefix (none for the control)."""
        s, rng = self.shape, random.Random(f"{self.shape.name}/{self.seed}/{n}")
        answer = max(self._n(s.answer_tokens), 1)
        if self.pool:
            group, own = self.pool[n % len(self.pool)]
            return [Turn((Message("system", self.prefixes[group]), Message("user", own)), answer)]
        first: list[Message] = []
        if self.prefixes:
            system = rng.choice(self.prefixes)
            if s.session_words:
                system += " " + words(rng, f"s{n}d", self._n(s.session_words))
            first.append(Message("system", system))
        first.append(Message("user", words(rng, f"s{n}u", self._n(s.own_words))))
        turns = [Turn(tuple(first), answer)]
        for k in range(1, rng.randint(*s.turns)):  # later turns: a tool's output, about as long
            turns.append(Turn((Message("user", words(rng, f"s{n}t{k}w", self._n(s.own_words))),), answer))
        return turns

    def prompt_words(self, n: int) -> list[int]:
        """The words each turn of session ``n`` sends, its history included (answers counted
        at their full length): what the tests check the shapes by."""
        out, history = [], 0
        for turn in self.session(n):
            history += sum(len(m.content.split()) for m in turn.messages)
            out.append(history)
            history += turn.max_tokens
        return out


def poisson_starts(rate: float, duration_s: float, seed: int) -> list[float]:
    """Open loop: session start times in [0, duration) of a Poisson process of ``rate`` per second."""
    rng, at, out = random.Random(seed), 0.0, []
    while True:
        at += rng.expovariate(rate)
        if at >= duration_s:
            return out
        out.append(at)

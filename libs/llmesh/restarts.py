"""How often a dead child process is restarted: exponential backoff within a budget of
restarts per window (``llmesh up``'s children, a gateway's worker processes)."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from llmesh.backoff import Backoff


@dataclass(frozen=True)
class RestartPolicy:
    """A dead child is restarted after ``backoff_initial_s``, doubling per restart up to
    ``backoff_max_s``, each delay jittered down by up to ``jitter`` of it (children that died
    together do not all come back at once); more than ``max_restarts`` exits within
    ``window_s`` and we give up."""
    max_restarts: int = 5
    window_s: float = 60.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    jitter: float = 0.5


@dataclass
class RestartBudget:
    policy: RestartPolicy
    recent: deque[Any] = field(default_factory=deque)   # monotonic times of restarts inside the window
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)
    _backoff: Backoff = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self.policy
        self._backoff = Backoff(initial_s=p.backoff_initial_s, max_s=p.backoff_max_s, jitter=p.jitter, rng=self.rng)

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before restarting a child that just died, or None: budget spent."""
        while self.recent and now - self.recent[0] > self.policy.window_s:
            self.recent.popleft()
        if len(self.recent) >= self.policy.max_restarts:
            return None
        delay = self._backoff.delay(len(self.recent) + 1)
        self.recent.append(now)
        return delay

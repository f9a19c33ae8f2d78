"""One exponential backoff with jitter, for every retry loop in the mesh.

A loop asks ``next()`` for how long to wait before its next try (and may log that
figure), sleeps, and calls ``reset()`` once a try succeeds. Delays double from
``initial_s`` up to ``max_s``; each is drawn from ``[delay * (1 - jitter), delay]``
so that many clients that lost the same server do not come back in step ("full
jitter" when ``jitter`` is 1). ``delay(attempt)`` is the same curve for callers
that count their own attempts (the supervisor's restart budget, the client's
retries)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    initial_s: float = 0.2
    max_s: float = 5.0
    factor: float = 2.0
    jitter: float = 0.5
    rng: random.Random = field(default_factory=random.Random, repr=False)
    _attempt: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (0 < self.initial_s <= self.max_s):
            raise ValueError("backoff needs 0 < initial_s <= max_s")
        if self.factor < 1 or not 0 <= self.jitter <= 1:
            raise ValueError("backoff needs factor >= 1 and 0 <= jitter <= 1")

    def ceiling(self, attempt: int) -> float:
        """The un-jittered delay before try ``attempt`` (1 = the first retry)."""
        if attempt < 1:
            return 0.0
        # Grows no further once max_s is reached (and never overflows for a large attempt).
        delay = self.initial_s
        for _ in range(attempt - 1):
            delay *= self.factor
            if delay >= self.max_s:
                return self.max_s
        return min(delay, self.max_s)

    def delay(self, attempt: int) -> float:
        """The jittered delay before try ``attempt`` (1 = the first retry)."""
        top = self.ceiling(attempt)
        return top * (1.0 - self.jitter * self.rng.random())

    def next(self) -> float:
        """The wait before the next try; each call without a ``reset`` waits longer."""
        self._attempt += 1
        return self.delay(self._attempt)

    def reset(self) -> None:
        self._attempt = 0

    @property
    def attempts(self) -> int:
        """Tries that failed since the last ``reset``."""
        return self._attempt

    async def sleep(self) -> float:
        """Waits ``next()`` seconds and says how long."""
        wait = self.next()
        await asyncio.sleep(wait)
        return wait

"""The requests held now for a scaled model with no ready replica (scale from zero):
the cold-start stage begins and ends holds; the demand reporter tells the scheduler."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable


class Holds:
    """The requests held now, per model, and since when. ``changed`` is set on every
    change so a reporter can tell the scheduler at once."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._held: dict[str, dict[int, float]] = {}
        self._ids = itertools.count()
        self.changed = asyncio.Event()

    def begin(self, model: str) -> int:
        token = next(self._ids)
        self._held.setdefault(model, {})[token] = self._clock()
        self.changed.set()
        return token

    def end(self, model: str, token: int) -> None:
        held = self._held.get(model, {})
        held.pop(token, None)
        if not held:
            self._held.pop(model, None)
        self.changed.set()

    def snapshot(self) -> dict[str, tuple[int, float]]:
        """Per model: how many are held and how long the oldest has waited."""
        now = self._clock()
        return {m: (len(h), now - min(h.values())) for m, h in self._held.items()}

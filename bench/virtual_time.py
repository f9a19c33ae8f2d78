"""An asyncio event loop on a virtual clock, for benches of in-process simulations.

``loop.time()`` reads a counter instead of the system clock, and when the loop would
wait for its next timer it moves the counter to that timer at once instead of
sleeping. Everything timed by the loop (``asyncio.sleep``, ``call_later``,
``wait_for``) keeps its meaning, so a simulation runs exactly as it would in real
time, only as fast as the CPU gets through its events, and the CPU it spends never
shows up in the times it measures. Only for code that does no real I/O: a wait on a
socket with no timer due would return at once, forever."""

from __future__ import annotations

import asyncio
import selectors


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; a wait of ``timeout`` seconds moves the clock instead."""

    def __init__(self, clock: list[float]):
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None):
        events = super().select(0)
        if not events and timeout:
            self._clock[0] += timeout
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0):
        self._clock = [start]
        super().__init__(selector=_JumpingSelector(self._clock))

    def time(self) -> float:
        return self._clock[0]

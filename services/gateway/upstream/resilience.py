"""Circuit breakers per endpoint and the retry budget: pure state, the clock and the
live config passed in, no I/O.

A breaker is closed (traffic flows), open (the endpoint is skipped) or half-open
(one probe is let through after ``reset_after_s``). It opens on consecutive
failures or on the error rate / p99 time to first token over a sliding window;
thresholds come from the live config on every call, so changes apply at once."""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from llmesh.liveconfig.schema import CircuitBreaker, RetryBudget


class BreakerState(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass
class _Breaker:
    state: BreakerState = BreakerState.CLOSED
    outcomes: deque[tuple[float, bool, bool]] = field(default_factory=deque)  # (time, failed, slow) over the window
    failures: int = 0  # in the window
    slow: int = 0  # in the window: first token later than latency_p99_s
    streak: int = 0  # failures in a row
    opened_at: float = 0.0
    probing: bool = False


class Breakers:
    def __init__(self, config: Callable[[], CircuitBreaker],
                 on_state: Callable[[str, BreakerState], None] = lambda endpoint, state: None):
        self._config = config
        self._on_state = on_state
        self._breakers: dict[str, _Breaker] = {}

    def state(self, endpoint: str, now: float) -> BreakerState:
        b = self._breakers.get(endpoint)
        if b is None:
            return BreakerState.CLOSED
        if b.state is BreakerState.OPEN and now - b.opened_at >= self._config().reset_after_s:
            self._move(endpoint, b, BreakerState.HALF_OPEN)
        return b.state

    def refusing(self, now: float) -> frozenset[str]:
        """Endpoints no request may go to now: open, or half-open with its probe out."""
        if not self._config().enabled:
            return frozenset()
        return frozenset(e for e, b in self._breakers.items()
                         if self.state(e, now) is BreakerState.OPEN
                         or (b.state is BreakerState.HALF_OPEN and b.probing))

    def attempt(self, endpoint: str, now: float) -> None:
        """A request goes to ``endpoint``; in half-open it is the probe."""
        b = self._breakers.get(endpoint)
        if b is not None and self.state(endpoint, now) is BreakerState.HALF_OPEN:
            b.probing = True

    def record(self, endpoint: str, ok: bool, ttft_s: float | None, now: float) -> None:
        cfg = self._config()
        b = self._breakers.setdefault(endpoint, _Breaker())
        state = self.state(endpoint, now)
        if state is BreakerState.HALF_OPEN:
            b.probing = False
            _clear(b)
            b.streak = 0 if ok else 1
            if ok:
                self._move(endpoint, b, BreakerState.CLOSED)
            else:
                self._open(endpoint, b, now)
            return
        if state is BreakerState.OPEN:
            return  # an answer that started before the breaker opened
        failed, slow = not ok, ok and ttft_s is not None and ttft_s > cfg.latency_p99_s
        b.outcomes.append((now, failed, slow))
        b.failures += failed
        b.slow += slow
        while b.outcomes and b.outcomes[0][0] < now - cfg.window_s:
            _, old_failed, old_slow = b.outcomes.popleft()
            b.failures -= old_failed
            b.slow -= old_slow
        b.streak = 0 if ok else b.streak + 1
        if cfg.enabled and (b.streak >= cfg.failure_threshold or self._unwell(b, cfg)):
            self._open(endpoint, b, now)

    @staticmethod
    def _unwell(b: _Breaker, cfg: CircuitBreaker) -> bool:
        """O(1): the p99 is over the limit exactly when more than 1 % of the window is."""
        n = len(b.outcomes)
        return n >= cfg.min_requests and (b.failures / n > cfg.error_rate or b.slow / n > 0.01)

    def _open(self, endpoint: str, b: _Breaker, now: float) -> None:
        b.opened_at = now
        _clear(b)
        self._move(endpoint, b, BreakerState.OPEN)

    def _move(self, endpoint: str, b: _Breaker, state: BreakerState) -> None:
        if b.state is not state:
            b.state = state
            self._on_state(endpoint, state)


def _clear(b: _Breaker) -> None:
    b.outcomes.clear()
    b.failures = b.slow = 0


class RetryBudgetGate:
    """Each request deposits ``ratio``; a retry spends 1 (denied below 1). The balance
    holds at most ``burst`` or ``ratio`` x the requests of the last ``window_s`` seconds,
    whichever is more: over any window retries add at most ``ratio`` to the load (a
    failing fleet is not hit twice), yet one engine of three dying, which sends a third
    of the requests in flight elsewhere at once, is paid from what the window saved."""

    def __init__(self, config: Callable[[], RetryBudget], window_s: int = 10,
                 clock: Callable[[], float] = time.monotonic):
        self._config = config
        self._clock = clock
        self._balance: float | None = None
        self._counts = [0] * window_s  # requests per second, a ring over the window
        self._second = int(clock())

    def _seen(self) -> int:
        now = int(self._clock())
        if now != self._second:
            for s in range(self._second + 1, min(now, self._second + len(self._counts)) + 1):
                self._counts[s % len(self._counts)] = 0
            self._second = now
        self._counts[now % len(self._counts)] += 1
        return sum(self._counts)

    def deposit(self) -> None:
        """A request starts."""
        cfg = self._config()
        cap = max(cfg.burst, cfg.ratio * self._seen())
        self._balance = min(cap, (cfg.burst if self._balance is None else self._balance) + cfg.ratio)

    def leave(self) -> None:
        """A request ends (nothing to undo: the window forgets it on its own)."""

    def spend(self) -> bool:
        cfg = self._config()
        if self._balance is None:
            self._balance = cfg.burst
        if self._balance < 1:
            return False
        self._balance -= 1
        return True

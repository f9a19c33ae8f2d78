"""The gateway's view of the engines, fed by the scheduler's stream, and the choice
of one for a request. Pure logic: no I/O, the clock is passed in."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Endpoint:
    endpoint_id: str
    address: str
    models: frozenset[str]
    running: int = 0
    waiting: int = 0
    max_running: int = 1
    healthy: bool = True


class EndpointPicker:
    """Least-loaded choice among healthy endpoints serving the model.

    Load is the larger of what the engine last reported (all gateways' work, up to
    one report old) and what this gateway has in flight there (exact, but only
    ours), divided by the engine's slot count. Ties are broken at random."""

    def __init__(self, rng: random.Random | None = None, down_for_s: float = 2.0):
        self._endpoints: dict[str, Endpoint] = {}
        self._seen_models: set[str] = set()
        self._inflight: dict[str, int] = {}
        self._down_until: dict[str, float] = {}
        self._down_for = down_for_s
        self._rng = rng or random.Random()

    def replace_all(self, endpoints: Iterable[Endpoint]) -> None:
        self._endpoints = {e.endpoint_id: e for e in endpoints}
        for e in self._endpoints.values():
            self._seen_models |= e.models

    def all(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def models(self) -> set[str]:
        """Models some endpoint serves now."""
        return {m for e in self._endpoints.values() for m in e.models}

    def seen_models(self) -> set[str]:
        """Models any endpoint has served since start: asking for one whose engines are
        all gone is 'unavailable', not 'no such model'."""
        return self._seen_models

    def pick(self, model: str, now: float, exclude: frozenset[str] = frozenset(),
             policy: str = "least_loaded") -> Endpoint | None:
        best: list[Endpoint] = []
        best_score = float("inf")
        for e in self._endpoints.values():
            if (not e.healthy or model not in e.models or e.endpoint_id in exclude
                    or self._down_until.get(e.endpoint_id, 0.0) > now):
                continue
            if policy == "random":
                best.append(e)
                continue
            load = max(e.running + e.waiting, self._inflight.get(e.endpoint_id, 0))
            score = load / max(e.max_running, 1)
            if score < best_score:
                best, best_score = [e], score
            elif score == best_score:
                best.append(e)
        if not best:
            return None
        return best[0] if len(best) == 1 else self._rng.choice(best)

    def acquire(self, endpoint_id: str) -> None:
        self._inflight[endpoint_id] = self._inflight.get(endpoint_id, 0) + 1

    def release(self, endpoint_id: str) -> None:
        left = self._inflight.get(endpoint_id, 0) - 1
        if left > 0:
            self._inflight[endpoint_id] = left
        else:
            self._inflight.pop(endpoint_id, None)

    def mark_down(self, endpoint_id: str, now: float) -> None:
        """Skip an endpoint that refused a connection until the scheduler catches up."""
        self._down_until[endpoint_id] = now + self._down_for

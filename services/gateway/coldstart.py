"""Scale from zero: a request for a scaled model (the live config's
``autoscaling.models``) that finds no ready replica is held here, its demand told to
the scheduler (``Holds`` -> ``DemandReporter`` -> Scheduler.ReportDemand), until a
replica is up and warm or ``autoscaling.hold_s`` (within the request's own timeout)
runs out: then 503 / UNAVAILABLE with Retry-After. Models that are not scaled, and
scaled ones with a ready replica, pass at the cost of one dict lookup and one pick
filter pass."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

from llmesh.errors import Unavailable
from llmesh.liveconfig.schema import MeshConfig
from llmesh.gateway.pipeline import Catalog, Context

RETRY_AFTER = "retry-after"


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


class ScaledCatalog:
    """A scaled model is a model clients may ask for even while none of its replicas runs."""

    def __init__(self, inner: Catalog, config: Callable[[], MeshConfig]):
        self._inner = inner
        self._config = config

    def known(self, model: str) -> bool:
        return self._inner.known(model) or model in self._config().autoscaling.models

    def names(self) -> list[str]:
        return sorted(set(self._inner.names()) | set(self._config().autoscaling.models))


class ColdStartStage:
    """Holds a request for a scaled model until it has a ready replica (see the module doc)."""

    def __init__(self, ready: Callable[[str], bool], holds: Holds, config: Callable[[], MeshConfig],
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 0.05):
        self._ready = ready
        self._holds = holds
        self._config = config
        self._clock = clock
        self._poll = poll_s

    async def admit(self, ctx: Context) -> None:
        scaling = self._config().autoscaling
        model = ctx.req.model
        if model not in scaling.models or self._ready(model):
            return
        started = self._clock()
        limit = min(scaling.hold_s, ctx.req.timeout_s)
        token = self._holds.begin(model)
        try:
            while not self._ready(model):
                if self._clock() - started >= limit:
                    raise Unavailable(
                        f"The model '{model}' has no replica ready yet; one is starting. Retry in "
                        f"{scaling.retry_after_s} s.", reason="scaling_up",
                        headers={RETRY_AFTER: str(scaling.retry_after_s)})
                await asyncio.sleep(self._poll)
        finally:
            self._holds.end(model, token)
            ctx.record.held_ms = round((self._clock() - started) * 1000, 3)

    async def finish(self, ctx: Context) -> None:
        pass

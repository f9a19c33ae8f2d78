"""Scale from zero: a request for a scaled model (the live config's
``autoscaling.models``) that finds no ready replica is held here, its demand told to
the scheduler (``Holds`` -> ``DemandReporter`` -> Scheduler.ReportDemand), until a
replica is up and warm or ``autoscaling.hold_s`` (within the request's own timeout)
runs out: then 503 / UNAVAILABLE with Retry-After. Models that are not scaled, and
scaled ones with a ready replica, pass at the cost of one dict lookup and one pick
filter pass."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from llmesh.errors import Unavailable
from llmesh.liveconfig.schema import MeshConfig
from llmesh.gateway.context import Context
from llmesh.gateway.domain.holds import Holds
from llmesh.gateway.stages.base import Stage

RETRY_AFTER = "retry-after"


class ColdStartStage(Stage):
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

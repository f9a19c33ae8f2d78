"""Flow control, in front of endpoint picking (the live config's ``flow_control``): when every
endpoint that could serve a request is saturated, the request waits in its tenant's queue
(services/gateway/domain/fairness.py) instead of a 429, and is released in token-weighted fair
order, highest class first, as capacity frees: an endpoint's load drops in the scheduler's
table, or a request this gateway sent ends. A request that cannot be served by its deadline
is refused at once (429 ``deadline`` with the estimated wait as Retry-After); one still waiting
at its deadline gets 504. Shed and preempted requests (only ever queued ones: nothing was sent
for them) get 429 with Retry-After and their reason.

The stage wraps the upstream innermost but for a cascade's (a cache hit never waits) and holds
the request's slot until its answer ends. This is one process's queues; with a Redis the workers and
replicas share one order per model (stages/flow_shared.py) and fall back to these while it is down."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from llmesh.errors import DeadlineExceeded, FlowRefused
from llmesh.liveconfig.schema import FlowControl, MeshConfig
from llmesh.gateway.context import CompletionRequest, Context, Items, Upstream
from llmesh.gateway.domain.degrade import load_of
from llmesh.gateway.domain.fairness import CLASS_OF, CLASSES, ClassRule, Entry, FairQueue, Refusal, Rules, Throughput
from llmesh.gateway.stages.base import Stage
from llmesh.gateway.upstream.picking.types import work_tokens

log = logging.getLogger("llmesh.gateway.flow")

MAX_METERED = 1024  # tenants whose own throughput a model's queue tracks at most
TICK_S = 0.1  # while requests wait: expiry, promotion and capacity looked at again this often at least
WHY = {"queue_full": "the model's queue is full", "tenant_queue_full": "this tenant's queue for the model is full",
       "preempted": "a request of a higher class took its place in the queue",
       "shed": "the queue is full and this tenant has the longest queue in its class",
       "deadline": "it cannot be served before its deadline at the current throughput"}

# (model, embed) -> (free slots, slots in all, this gateway's requests in flight there)
Capacity = Callable[[str, bool, int], tuple[int, int, int]]


class FlowObserver(Protocol):
    def queued(self, model: str, tenant: str, klass: str, delta: int) -> None: ...
    def waited(self, model: str, tenant: str, klass: str, seconds: float) -> None: ...
    def refused(self, model: str, tenant: str, klass: str, reason: str) -> None: ...
    def weighted(self, tenant: str, weight: float) -> None: ...


class _NoMetrics:
    def queued(self, model: str, tenant: str, klass: str, delta: int) -> None:
        pass

    def waited(self, model: str, tenant: str, klass: str, seconds: float) -> None:
        pass

    def refused(self, model: str, tenant: str, klass: str, reason: str) -> None:
        pass

    def weighted(self, tenant: str, weight: float) -> None:
        pass


@dataclass(slots=True)
class _Model:
    queue: FairQueue
    embed: bool
    meter: Throughput = field(default_factory=Throughput)
    tenants: dict[str, Throughput] = field(default_factory=dict)  # each tenant's share of it (bounded)
    waiters: dict[Entry, asyncio.Future[None]] = field(default_factory=dict)
    counted: dict[Entry, int] = field(default_factory=dict)  # queued entries, by the class they are counted in
    released: int = 0  # entries holding a slot


class FlowController:
    """Every model's queue in this gateway process, and the waits on them."""

    def __init__(self, config: Callable[[], MeshConfig], capacity: Capacity, retry_after_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, metrics: FlowObserver | None = None):
        self._config = config
        self._capacity = capacity
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._metrics = metrics or _NoMetrics()
        self._models: dict[str, _Model] = {}
        self._rules: tuple[FlowControl, Rules] | None = None
        self._wake = asyncio.Event()

    @property
    def retry_after_s(self) -> float:
        """The Retry-After of a refusal when there is no estimate."""
        return self._retry_after_s

    def rules(self) -> Rules:
        fc = self._config().flow_control
        if self._rules is None or self._rules[0] is not fc:
            self._rules = fc, Rules(fc.max_queued_per_tenant, fc.max_queued,
                                    {k: ClassRule(c.reserved_share, c.promote_after_s) for k, c in fc.classes.items()},
                                    fc.burst_tokens, fc.quiet_share)
        return self._rules[1]

    def _free(self, model: str, m: _Model) -> tuple[int, int]:
        free, total, ours = self._capacity(model, m.embed, self._config().flow_control.engine_queue)
        starting = max(0, m.released - ours)  # released here, not yet in flight at an endpoint
        return max(0, free - starting), total

    async def acquire(self, model: str, entry: Entry, embed: bool) -> bool:
        """Waits for a slot for ``entry``; False when flow control does not apply (no endpoint
        of the model is known: a provider's, or one scaling from zero). Raises its refusal."""
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _Model(FairQueue(self.rules(), self._retry_after_s), embed)
        free, total = self._free(model, m)
        if total == 0:
            return False
        m.queue.rules = self.rules()
        now = self._clock()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        m.waiters[entry] = fut
        mine = m.tenants.get(entry.tenant)
        self._settle(model, m, m.queue.offer(entry, now, free, total, m.meter.rate(now), m.meter.mean_cost(),
                                             mine.rate(now) if mine is not None else None))
        if entry.queued:
            self._count(model, m, entry)
            self._wake.set()
        try:
            await fut
        except asyncio.CancelledError:
            m.waiters.pop(entry, None)
            if entry.queued:
                m.queue.withdraw(entry)
                self._uncount(model, m, entry)
            elif entry.released:
                self.done(model, entry, served=False)
            raise
        return True

    def done(self, model: str, entry: Entry, served: bool = True) -> None:
        """A released request's answer ended: its slot goes to the next in fair order."""
        m = self._models[model]
        if entry.released:
            m.released -= 1
        m.queue.done(entry)
        if served:
            now = self._clock()
            m.meter.record(now, entry.cost)
            if entry.tenant not in m.tenants and len(m.tenants) >= MAX_METERED:
                m.tenants = {t: x for t, x in m.tenants.items() if x.rate(now) is not None}  # the active ones
            if entry.tenant in m.tenants or len(m.tenants) < MAX_METERED:
                m.tenants.setdefault(entry.tenant, Throughput()).record(now, entry.cost)
        self._release(model, m)

    def load(self, model: str, embed: bool = False) -> float | None:
        """``model``'s load as flow control sees it: in flight at its endpoints and waiting here,
        over its slots (domain/degrade.py); None: no endpoint of it is known."""
        m = self._models.get(model)
        if m is None:
            free, total, _ = self._capacity(model, embed, self._config().flow_control.engine_queue)
            return load_of(free, total, 0)
        free, total = self._free(model, m)
        return load_of(free, total, m.queue.queued)

    def poke(self) -> None:
        """The endpoint table changed: capacity may have freed."""
        self._wake.set()

    def _release(self, model: str, m: _Model) -> None:
        if m.queue.queued:
            free, total = self._free(model, m)
            self._settle(model, m, [(e, None) for e in m.queue.release(free, total)])

    def _settle(self, model: str, m: _Model, out: list[tuple[Entry, Refusal | None]]) -> None:
        now = self._clock()
        for e, why in out:
            self._uncount(model, m, e)
            fut = m.waiters.pop(e, None)
            klass = CLASSES[e.klass]
            if why is None:
                m.released += 1
                self._metrics.waited(model, e.tenant, klass, now - e.arrived)
                if fut is not None and not fut.done():
                    fut.set_result(None)
                continue
            self._metrics.refused(model, e.tenant, klass, why.reason)
            log.info("request refused by flow control", extra={
                "model": model, "tenant": e.tenant, "class": klass, "reason": why.reason,
                "waited_s": round(now - e.arrived, 3), "retry_after_s": round(why.retry_after_s, 3)})
            if fut is not None and not fut.done():
                fut.set_exception(refusal_error(model, why))

    def _count(self, model: str, m: _Model, e: Entry) -> None:
        m.counted[e] = e.klass
        self._metrics.queued(model, e.tenant, CLASSES[e.klass], 1)
        self._metrics.weighted(e.tenant, e.weight)  # a tenant that waits: its weight, beside its share

    def _uncount(self, model: str, m: _Model, e: Entry) -> None:
        klass = m.counted.pop(e, None)
        if klass is not None:
            self._metrics.queued(model, e.tenant, CLASSES[klass], -1)

    def tick(self) -> float | None:
        """Deadlines, promotions and freed capacity, for every model; returns when to look again
        (None: nothing waits)."""
        now, wake, rules = self._clock(), None, self.rules()
        for model, m in self._models.items():
            if not m.queue.queued:
                continue
            m.queue.rules = rules  # a new live config applies to those waiting too
            self._settle(model, m, [(e, r) for e, r in m.queue.expire(now)])
            for e in m.queue.promote(now):
                self._uncount(model, m, e)
                self._count(model, m, e)
            self._release(model, m)
            if m.queue.queued:
                due = min(now + TICK_S, m.queue.next_deadline() or now + TICK_S)
                wake = due if wake is None else min(wake, due)
        return wake

    async def run(self) -> None:
        """Wakes for the ticks while requests wait, and at once on a poke."""
        while True:
            self._wake.clear()
            wake = self.tick()
            timeout = None if wake is None else max(0.0, wake - self._clock())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass


def refusal_error(model: str, why: Refusal) -> Exception:
    if why.reason == "expired":
        return DeadlineExceeded(f"The request's deadline came while it waited for capacity for the model '{model}'.")
    return FlowRefused(f"Refused for the model '{model}': {WHY.get(why.reason, why.reason)}; retry in "
                       f"{why.retry_after_s:.3g} s.", why.reason, why.retry_after_s)


class Flow(Protocol):
    """Flow control's queues: this process's (FlowController) or shared over Redis (flow_shared)."""

    async def acquire(self, model: str, entry: Entry, embed: bool) -> bool: ...

    def done(self, model: str, entry: Entry, served: bool = True) -> None: ...


class FlowStage(Stage):
    """Puts the request's wait for capacity (and its slot) around the upstream."""

    def __init__(self, flow: Flow, config: Callable[[], MeshConfig],
                 clock: Callable[[], float] = time.monotonic):
        self._flow = flow
        self._config = config
        self._clock = clock

    async def admit(self, ctx: Context) -> None:
        config = self._config()
        fc = config.flow_control
        if not fc.enabled:
            return
        req = ctx.req
        cost = work_tokens(req.prompt, req.sampling.max_tokens, fc.default_output_tokens, req.inputs)
        now = self._clock()
        entry = Entry(tenant=req.tenant, klass=CLASS_OF.get(req.priority, 1), cost=float(max(cost, 1)),
                      arrived=now, deadline=now + req.timeout_s, weight=config.tenant(req.tenant).weight)
        ctx.wrap(partial(self._held, entry))

    async def _held(self, entry: Entry, req: CompletionRequest, upstream: Upstream) -> Items:
        model = req.model
        held = await self._flow.acquire(model, entry, req.embeds)
        served = False
        try:
            async with aclosing(upstream(req)) as items:
                async for item in items:
                    served = True
                    yield item
        finally:
            if held:
                self._flow.done(model, entry, served)

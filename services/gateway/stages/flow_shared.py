"""Flow control shared by every gateway worker and replica through Redis: one fair order and one
queue depth per model (services/gateway/domain/fairness_redis.py). The waiting requests stay in
the worker that holds them; the shared queue decides who goes next and how many slots are left.

A worker learns that its entry was released or refused from the entry's status: at once when it
released it itself, else on the next wake (a PUBLISH on the model's channel) or tick (0.1 s).
While Redis does not answer, requests queue in this worker's own FlowController (stages/flow.py),
as limits do (FallbackLimiter), counted by ``llmesh_flow_shared_fallback``; those waiting in Redis
then move there. A request that the estimate says cannot get a slot before its deadline (the cost
queued ahead of it over the throughput every worker measured, and at least its tenant's own queue
ahead of it over what that tenant was served) is refused at once, as in one process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmesh.background import honour_cancel
from llmesh.liveconfig.schema import MeshConfig
from llmesh.gateway.domain.degrade import load_of
from llmesh.gateway.domain.fairness import CLASSES, Entry, Refusal, Rules
from llmesh.gateway.domain.fairness_redis import Entered, SharedQueue
from llmesh.gateway.stages.flow import TICK_S, WHY, FlowController, FlowObserver, refusal_error

log = logging.getLogger("llmesh.gateway.flow")

BEAT_S = 1.0  # heartbeat period; a worker silent for ``ttl_ms`` loses its entries


def _wake(waker: asyncio.Future[None]) -> None:
    if not waker.done():
        waker.set_result(None)


class _StoreDown(Exception):
    """Redis stopped answering while the entry waited there: it queues locally instead."""


@dataclass(slots=True)
class _Model:
    queue: SharedQueue
    embed: bool
    waiting: dict[str, tuple[Entry, asyncio.Future[None]]] = field(default_factory=dict)  # by entry id
    held: dict[Entry, str] = field(default_factory=dict)  # released entries -> their ids
    strays: set[str] = field(default_factory=set)  # ids Redis holds for this worker, unknown here at the last beat
    queued: int = 0  # over every worker, as of the last tick
    busy: int = 0  # released and not done, over every worker, as of the last tick


class SharedFlowController:
    """The FlowController's interface (acquire, done, load, poke, run) over the shared queue."""

    def __init__(self, redis: Any, local: FlowController, config: Callable[[], MeshConfig],
                 capacity: Callable[[str, bool, int], tuple[int, int, int]], metrics: FlowObserver,
                 errors: tuple[type[BaseException], ...] = (OSError,), retry_s: float = 5.0, ttl_ms: int = 5000,
                 on_fallback: Callable[[], None] = lambda: None, worker: str | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self._redis = redis
        self._local = local
        self._config = config
        self._capacity = capacity
        self._metrics = metrics
        self._errors = errors
        self._retry_s = retry_s
        self._ttl_ms = ttl_ms
        self._on_fallback = on_fallback
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._clock = clock
        self._wall = wall
        self._models: dict[str, _Model] = {}
        self._local_entries: set[Entry] = set()
        self._orphans: list[tuple[_Model, str]] = []  # entries to take out of Redis when it answers again
        self._down_until = 0.0
        self._poked = False
        self._waker: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_beat = 0.0

    def _now_ms(self) -> int:
        return int(self._wall() * 1000)

    def _failed(self, exc: BaseException) -> None:
        if self._clock() >= self._down_until:
            log.warning("redis unreachable: flow control queues in this worker", extra={"error": repr(exc)})
        self._down_until = self._clock() + self._retry_s
        self._on_fallback()
        for model, m in self._models.items():  # those waiting in Redis queue here instead
            for eid in list(m.waiting):
                _, fut = self._forget(model, m, eid) or (None, None)
                if fut is not None and not fut.done():
                    fut.set_exception(_StoreDown())

    def _model(self, model: str, embed: bool) -> _Model:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _Model(SharedQueue(self._redis, model, self.worker, self._ttl_ms), embed)
        return m

    def _free(self, model: str, m: _Model) -> tuple[int, int]:
        free, total, ours = self._capacity(model, m.embed, self._config().flow_control.engine_queue)
        return max(0, free - max(0, len(m.held) - ours)), total

    async def acquire(self, model: str, entry: Entry, embed: bool) -> bool:
        """Waits for a slot for ``entry`` in the shared order (or this worker's, while Redis is
        down); False when flow control does not apply. Raises its refusal."""
        if self._clock() < self._down_until:
            return await self._acquire_local(model, entry, embed)
        m = self._model(model, embed)
        free, total = self._free(model, m)
        if total == 0:
            return False
        rules = self._local.rules()
        try:
            got = await self._enter(m, entry, rules, free, total)
        except self._errors as exc:
            self._failed(exc)
            return await self._acquire_local(model, entry, embed)
        klass = CLASSES[entry.klass]
        if got.status != "queued":
            self._refused(model, entry, got.status, got.wait_s)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        m.waiting[got.eid] = (entry, fut)
        entry.queued = True
        self._metrics.queued(model, entry.tenant, klass, 1)
        self._metrics.weighted(entry.tenant, entry.weight)
        try:
            if got.victim in m.waiting:
                await self._settle(model, m, {got.victim: "preempted"})
            await self._release(model, m, free, total)
            await self._refuse_if_too_late(model, m, got, entry)
            await fut
        except _StoreDown:
            self._orphans.append((m, got.eid))  # it leaves the shared queue once Redis answers
            return await self._acquire_local(model, entry, embed)
        except BaseException:
            waiting = self._forget(model, m, got.eid) is not None  # else a refusal already took it out
            if entry.released:
                self.done(model, entry, served=False)
            elif waiting:
                self._spawn(self._leave(m, got.eid))
            raise
        return True

    async def _enter(self, m: _Model, entry: Entry, rules: Rules, free: int, total: int) -> Entered:
        """Queues ``entry`` in Redis. A cancel (the client went) that lands before Redis answered
        takes the entry out once it has: else it would keep its place, then a slot, until this
        worker dies."""
        call = asyncio.ensure_future(m.queue.enter(entry, rules, self._now_ms(), free, total))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            self._spawn(self._withdraw(m, call))
            raise

    async def _withdraw(self, m: _Model, call: asyncio.Future[Entered]) -> None:
        try:
            got = await call
        except self._errors:
            return  # Redis did not answer: as in acquire, whether it queued the entry is not known
        if got.status == "queued":
            await self._leave(m, got.eid)

    async def _refuse_if_too_late(self, model: str, m: _Model, got: Entered, entry: Entry) -> None:
        """Refuses ``entry`` (raises, 429 ``deadline``) when it is still queued and its estimated
        wait runs past its deadline; returns when it may wait."""
        if got.wait_s is None or got.eid not in m.waiting or self._clock() + got.wait_s <= entry.deadline:
            return
        if await m.queue.leave(got.eid, "deadline", only_queued=True) != "queued":
            return  # released (or gone) meanwhile: its status tells the waiter
        self._forget(model, m, got.eid)
        self._refused(model, entry, "deadline", got.wait_s)

    async def _acquire_local(self, model: str, entry: Entry, embed: bool) -> bool:
        entry.queued = entry.released = False
        held = await self._local.acquire(model, entry, embed)
        if held:
            self._local_entries.add(entry)
        return held

    def _refused(self, model: str, entry: Entry, reason: str, retry_after_s: float | None = None) -> None:
        why = Refusal(reason, self._local.retry_after_s if retry_after_s is None else retry_after_s)
        self._metrics.refused(model, entry.tenant, CLASSES[entry.klass], reason)
        log.info("request refused by flow control", extra={
            "model": model, "tenant": entry.tenant, "class": CLASSES[entry.klass], "reason": reason,
            "waited_s": round(self._clock() - entry.arrived, 3), "retry_after_s": why.retry_after_s})
        raise refusal_error(model, why)

    def _forget(self, model: str, m: _Model, eid: str) -> tuple[Entry, asyncio.Future[None]] | None:
        got = m.waiting.pop(eid, None)
        if got is not None and got[0].queued:
            got[0].queued = False
            self._metrics.queued(model, got[0].tenant, CLASSES[got[0].klass], -1)
        return got

    async def _release(self, model: str, m: _Model, free: int, total: int) -> None:
        released = await m.queue.release(free, total, self._local.rules(), self._now_ms())
        await self._settle(model, m, {eid: "released" for eid in released if eid in m.waiting})

    async def _settle(self, model: str, m: _Model, statuses: dict[str, str]) -> None:
        """Wakes this worker's waiters whose entries were released or refused."""
        now = self._clock()
        for eid, status in statuses.items():
            if status == "queued" or eid not in m.waiting:
                continue
            got = self._forget(model, m, eid)
            assert got is not None
            entry, fut = got
            if status == "released":
                entry.released = True
                m.held[entry] = eid
                self._metrics.waited(model, entry.tenant, CLASSES[entry.klass], now - entry.arrived)
                if not fut.done():
                    fut.set_result(None)
                continue
            wait = None
            if status in ("preempted", "shed"):  # another's arrival displaced it: the estimate it was given
                with contextlib.suppress(*self._errors):
                    wait = await m.queue.refusal_wait(eid)
            self._spawn(self._leave(m, eid))  # read: the entry goes
            try:
                self._refused(model, entry, status if status in WHY else "expired", wait)
            except Exception as exc:  # noqa: BLE001 - the waiter gets its refusal
                if not fut.done():
                    fut.set_exception(exc)

    def done(self, model: str, entry: Entry, served: bool = True) -> None:
        """A released request's answer ended: its slot goes back to the shared queue."""
        if entry in self._local_entries:
            self._local_entries.discard(entry)
            self._local.done(model, entry, served)
            return
        m = self._models[model]
        eid = m.held.pop(entry, None)
        entry.released = False
        if eid is not None:
            self._spawn(self._leave(m, eid, served=served))
        self._poke_shared()

    async def _leave(self, m: _Model, eid: str, why: str = "withdrawn", served: bool = False) -> str:
        try:
            return await m.queue.leave(eid, why, self._now_ms(), served)
        except self._errors as exc:  # it leaves once Redis answers again
            self._orphans.append((m, eid))
            self._failed(exc)
            return ""

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def load(self, model: str, embed: bool = False) -> float | None:
        """As FlowController's, with the queued requests of every worker."""
        m = self._models.get(model)
        if m is None or self._clock() < self._down_until:
            return self._local.load(model, embed)
        free, total = self._free(model, m)
        return load_of(free, total, max(m.queued, len(m.waiting)))

    def poke(self) -> None:
        self._poke_shared()
        self._local.poke()

    async def tick(self) -> None:
        """This worker's expired entries out, capacity released (which keeps the heartbeat of a
        model where this worker has entries), statuses read."""
        while self._orphans:  # an error leaves the rest for the next tick
            await self._orphans[0][0].queue.leave(self._orphans[0][1])
            self._orphans.pop(0)
        now = self._clock()
        beat = now - self._last_beat >= BEAT_S
        if beat:
            self._last_beat = now
        for model, m in self._models.items():
            if not (m.waiting or m.queued or beat):  # each beat looks: a dead worker's entries are reaped
                continue
            if beat:
                await self._sweep(m)
            for eid, (entry, _) in list(m.waiting.items()):
                if entry.deadline <= now and await m.queue.leave(eid, "expired") != "released":
                    await self._settle(model, m, {eid: "expired"})
            if m.queued or m.waiting:
                self._promoted(model, m, await m.queue.promote(self._local.rules(), self._now_ms()))
            free, total = self._free(model, m)
            await self._release(model, m, free, total)
            if m.waiting:
                await self._settle(model, m, await m.queue.statuses(list(m.waiting)))
            m.queued, m.busy = await m.queue.counts()

    @staticmethod
    async def _sweep(m: _Model) -> None:
        """Takes out the entries Redis holds for this worker that it does not know: an enter whose
        answer was lost (an error after Redis had run it) would keep its place, then a slot, for as
        long as this worker lives. An entry unknown on two beats in a row goes (an enter or a leave
        in flight is unknown for milliseconds, not a beat)."""
        unknown = await m.queue.owned() - set(m.waiting) - set(m.held.values())
        for eid in unknown & m.strays:
            await m.queue.leave(eid)
        m.strays = unknown - m.strays

    def _promoted(self, model: str, m: _Model, eids: list[str]) -> None:
        """This worker's entries among those promoted: counted in their new class."""
        for eid in eids:
            if eid in m.waiting:
                e = m.waiting[eid][0]
                self._metrics.queued(model, e.tenant, CLASSES[e.klass], -1)
                e.klass += 1
                self._metrics.queued(model, e.tenant, CLASSES[e.klass], 1)

    async def run(self) -> None:
        """Ticks every 0.1 s, at once on a poke or a PUBLISH; runs the local fallback's loop too."""
        children = [asyncio.create_task(self._local.run()), asyncio.create_task(self._listen())]
        try:
            while True:
                self._poked = False
                if self._clock() >= self._down_until:
                    try:
                        await self.tick()
                    except self._errors as exc:
                        self._failed(exc)
                await self._nap()
        finally:
            for task in children:
                task.cancel()

    def _poke_shared(self) -> None:
        self._poked = True
        if self._waker is not None and not self._waker.done():
            self._waker.set_result(None)

    async def _nap(self) -> None:
        """Until TICK_S has passed or a poke came (a plain future: a cancel is never swallowed)."""
        if self._poked:
            return
        loop = asyncio.get_running_loop()
        self._waker = waker = loop.create_future()
        timer = loop.call_later(TICK_S, _wake, waker)
        try:
            await waker
        finally:
            timer.cancel()
            self._waker = None

    async def _listen(self) -> None:
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.psubscribe("llmesh:fq:*wake")
                async for message in pubsub.listen():
                    honour_cancel()
                    if message.get("type") == "pmessage":
                        self._poke_shared()
            except self._errors:
                await asyncio.sleep(self._retry_s)
            finally:
                await pubsub.aclose()

"""Keeps one Report stream open to the scheduler: registers this engine, sends its
load when it changes (at most every ``min_gap_s``) and at least every ``interval_s``.
Reconnects with backoff; ends the stream cleanly on drain so the scheduler forgets us."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from llmesh.backoff import Backoff
from llmesh.discovery.base import Resolver
from llmesh.errors import DiscoveryError
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import Identity
from llmesh.v1 import engine_pb2, scheduler_pb2, scheduler_pb2_grpc
from llmesh.convert import kv_event_to_pb, kv_hash_to_pb
from llmesh.engine.backends.base import KvEventSource

log = logging.getLogger("llmesh.engine.reporter")


class Reporter:
    def __init__(self, scheduler: Resolver, identity: scheduler_pb2.EngineReport,
                 load: Callable[[], engine_pb2.EngineLoad], interval_s: float = 1.0,
                 min_gap_s: float = 0.05,
                 extra: Callable[[], tuple[scheduler_pb2.HardwareProfile, scheduler_pb2.SelfTest]] | None = None,
                 kv: Callable[[], KvEventSource] | None = None, caller: Identity | None = None,
                 served: Callable[[], list[scheduler_pb2.ServedModel]] | None = None):
        self._resolve = scheduler
        self._caller = caller  # the scheduler takes reports from engine identities only
        self._identity = identity
        self._load = load
        self._extra = extra
        self._kv = kv
        self._served = served
        self._interval = interval_s
        self._min_gap = min_gap_s
        self._changed = asyncio.Event()
        self._draining = False
        self._done = asyncio.Event()
        self._task: asyncio.Task | None = None

    def notify(self) -> None:
        self._changed.set()

    def set_draining(self, draining: bool) -> None:
        """Out of routing (a model swap) or back in; the next report says so."""
        self._draining = draining
        self.notify()

    def set_models(self, models: list[str]) -> None:
        """After a model load or unload: the next report says what we serve now."""
        del self._identity.models[:]
        self._identity.models.extend(models)
        self.notify()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-reporter")

    async def stop(self, timeout: float = 2.0) -> None:
        """Tell the scheduler we are draining, then close the stream."""
        if self._task is None:
            return
        self._draining = True
        self._done.set()
        self._changed.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError):
            self._task.cancel()

    async def _run(self) -> None:
        backoff = Backoff(initial_s=0.2, max_s=5.0)
        while not self._done.is_set():
            address = "?"
            try:
                address = await self._resolve()  # anew on every (re)connect
                async with mesh_channel(address, "scheduler", self._caller) as channel:
                    await scheduler_pb2_grpc.SchedulerStub(channel).Report(self._reports())
                backoff.reset()
            except (grpc.aio.AioRpcError, DiscoveryError, OSError) as exc:
                wait = backoff.next()
                log.warning("scheduler report stream broke", extra={
                    "scheduler": address, "retry_in_s": wait,
                    "error": exc.code().name if isinstance(exc, grpc.aio.AioRpcError)
                    else f"{type(exc).__name__}: {exc}"})
                await asyncio.sleep(wait)

    async def _reports(self) -> AsyncIterator[scheduler_pb2.EngineReport]:
        source = None  # the KV event source the scheduler has heard from on this stream
        while True:
            report = scheduler_pb2.EngineReport()
            report.CopyFrom(self._identity)
            report.load.CopyFrom(self._load())
            if self._extra is not None:
                hardware, self_test = self._extra()
                report.hardware.CopyFrom(hardware)
                report.self_test.CopyFrom(self_test)
            report.draining = self._draining
            if self._served is not None:
                report.served.extend(self._served())
            if self._kv is not None:
                current = self._kv()  # a model swap brings a new source: start over from it
                events = current.take_events() if current is source else current.resync()
                source = current
                report.kv_events.extend(kv_event_to_pb(e.kind, e.hashes) for e in events)
                # always set: an engine whose hashes match nothing (no model) says so too
                report.kv_hash.CopyFrom(kv_hash_to_pb(current.scheme) or scheduler_pb2.KvHashScheme())
            yield report
            if self._done.is_set():
                return
            self._changed.clear()
            try:  # asyncio.timeout: 3.11's wait_for can swallow a cancel that lands as the wait ends
                async with asyncio.timeout(self._interval):
                    await self._changed.wait()
            except TimeoutError:
                pass
            if not self._done.is_set():
                await asyncio.sleep(self._min_gap)

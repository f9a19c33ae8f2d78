"""Tells the scheduler what this gateway holds for models with no ready replica
(Scheduler.ReportDemand): at once when a hold starts or ends, every ``interval_s``
while any lasts, and one empty report when the last one ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from llmesh.discovery.base import Resolver
from llmesh.errors import DiscoveryError
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import Identity
from llmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from llmesh.gateway.domain.holds import Holds
from llmesh.gateway.upstream.rpc import why

log = logging.getLogger("llmesh.gateway.demand")


class DemandReporter:
    def __init__(self, resolve: Resolver, holds: Holds, gateway_id: str, identity: Identity | None = None,
                 interval_s: float = 1.0):
        self._resolve = resolve
        self._holds = holds
        self._id = gateway_id
        self._identity = identity
        self._interval = interval_s

    async def run(self) -> None:
        channel: grpc.aio.Channel | None = None
        reported_any = False
        try:
            while True:
                if not self._holds.snapshot() and not reported_any:
                    await self._holds.changed.wait()  # nothing held, nothing said: sleep until a hold
                self._holds.changed.clear()
                held = self._holds.snapshot()
                try:
                    if channel is None:
                        channel = mesh_channel(await self._resolve(), "scheduler", self._identity)
                    await scheduler_pb2_grpc.SchedulerStub(channel).ReportDemand(scheduler_pb2.ReportDemandRequest(
                        gateway_id=self._id, held=[scheduler_pb2.HeldRequests(model=m, count=n, oldest_wait_s=w)
                                                   for m, (n, w) in held.items()]), timeout=2)
                    reported_any = bool(held)
                except (grpc.aio.AioRpcError, DiscoveryError) as exc:
                    log.warning("cannot report held requests to the scheduler", extra={"error": why(exc)})
                    if channel is not None:
                        await channel.close()
                        channel = None
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
                # lands as the wait ends, and this loop would then never stop
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._interval):
                        await self._holds.changed.wait()
        finally:
            if channel is not None:
                await channel.close()

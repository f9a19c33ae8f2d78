"""Scheduler composition root."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from llmesh.platform import Platform
from llmesh.rpc.server import GrpcServer, ServiceBinding
from llmesh.v1 import scheduler_pb2_grpc
from prometheus_client import CollectorRegistry

from llmesh.liveconfig.schema import MeshConfig
from llmesh.scheduler.autoscale import Decision, FleetScaler
from llmesh.scheduler.config import SchedulerSettings
from llmesh.scheduler.health import HealthJudge
from llmesh.scheduler.metrics import SchedulerMetrics
from llmesh.scheduler.servicer import SchedulerServicer
from llmesh.scheduler.table import EndpointTable

log = logging.getLogger("llmesh.scheduler")


class SchedulerApp:
    def __init__(self, settings: SchedulerSettings, platform: Platform | None = None):
        self.settings = settings
        self.metrics = SchedulerMetrics(platform.metrics if platform else CollectorRegistry())
        self.table = EndpointTable(stale_after_s=settings.stale_after_s, on_change=self.metrics.table_changed,
                                   judge=HealthJudge(settings.ecc_quiet_s, settings.latency_drift_factor,
                                                     settings.latency_drift_min_ms,
                                                     settings.latency_drift_min_peers))
        config = (lambda: platform.config.current) if platform else MeshConfig
        self.scaler = FleetScaler(self.table.snapshot, lambda: config().autoscaling, self._decided,
                                  settings.demand_ttl_s)
        self.server = GrpcServer(settings.address, [ServiceBinding(
            "llmesh.v1.Scheduler", SchedulerServicer(self.table, self.metrics.reports, scaler=self.scaler),
            scheduler_pb2_grpc.add_SchedulerServicer_to_server)],
            tracer=platform.tracing.tracer if platform else None,
            identity=platform.identity if platform else None, bind_wait_s=settings.bind_wait_s,
            serving=platform.serving if platform else None)
        self._tasks: list[asyncio.Task] = []

    def _decided(self, decisions: list[Decision]) -> None:
        self.metrics.scaled(decisions)
        for d in decisions:
            if d.changed:
                log.info("desired replicas changed", extra={
                    "model": d.model, "desired": d.desired, "previous": d.previous, "reason": d.reason,
                    "ready": d.load.ready, "running": d.load.running, "waiting": d.load.waiting})

    @property
    def advertise_address(self) -> str:
        return self.server.bound_address

    @property
    def health_service(self) -> str:
        return "llmesh.v1.Scheduler"

    async def start(self) -> None:
        await self.server.start()
        self._tasks = [asyncio.create_task(self._expire_loop(), name="expire-endpoints"),
                       asyncio.create_task(self._scale_loop(), name="autoscale")]

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.settings.stale_after_s / 3))
            await self.table.expire(time.monotonic())

    async def _scale_loop(self) -> None:
        while True:
            self.scaler.tick(time.monotonic())
            await asyncio.sleep(self.settings.autoscale_interval_s)

    async def stop(self, grace: float) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Watch streams never end on their own: give them no grace.
        await self.server.stop(min(grace, 1.0))

"""Scheduler metrics: the fleet as the scheduler sees it."""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge

from llmesh.scheduler.table import EndpointState


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.endpoints = Gauge("llmesh_scheduler_endpoints", "Engine endpoints by state.", ("state",),
                               registry=registry)
        self.replicas = Gauge("llmesh_scheduler_replicas", "Replicas per model: actual (healthy) now; desired "
                              "comes with the autoscaler.", ("model", "kind"), registry=registry)
        self.reports = Counter("llmesh_scheduler_reports", "Load reports received from engines.",
                               registry=registry)
        self._models: set[str] = set()

    def table_changed(self, endpoints: list[EndpointState]) -> None:
        states = Tally("draining" if e.draining else "healthy" if e.healthy else "unhealthy" for e in endpoints)
        for state in ("healthy", "unhealthy", "draining"):
            self.endpoints.labels(state).set(states[state])
        healthy = Tally(m for e in endpoints if e.healthy for m in e.models)
        self._models |= set(healthy)
        for model in self._models:
            self.replicas.labels(model, "actual").set(healthy[model])

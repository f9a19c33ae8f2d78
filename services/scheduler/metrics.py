"""Scheduler metrics: the fleet as the scheduler sees it."""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge

from llmesh.scheduler.autoscale import Decision
from llmesh.scheduler.table import EndpointState


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.endpoints = Gauge("llmesh_scheduler_endpoints", "Engine endpoints by state.", ("state",),
                               registry=registry)
        self.replicas = Gauge("llmesh_scheduler_replicas", "Replicas per model: actual (healthy) now; desired "
                              "(the autoscaler's count, for scaled models; KEDA scales on it).", ("model", "kind"),
                              registry=registry)
        self.queue = Gauge("llmesh_scheduler_queue_depth", "Requests waiting per scaled model: engine queues plus "
                           "requests gateways hold for a model with no ready replica.", ("model",), registry=registry)
        self.scale_changes = Counter("llmesh_scheduler_scale_changes", "Changes of a model's desired replicas.",
                                     ("model", "reason"), registry=registry)
        self.reports = Counter("llmesh_scheduler_reports", "Load reports received from engines.",
                               registry=registry)
        self._models: set[str] = set()
        self._scaled: set[str] = set()

    def table_changed(self, endpoints: list[EndpointState]) -> None:
        states = Tally("draining" if e.draining else "healthy" if e.healthy else "unhealthy" for e in endpoints)
        for state in ("healthy", "unhealthy", "draining"):
            self.endpoints.labels(state).set(states[state])
        healthy = Tally(m for e in endpoints if e.healthy for m in e.models)
        self._models |= set(healthy)
        for model in self._models:
            self.replicas.labels(model, "actual").set(healthy[model])

    def scaled(self, decisions: list[Decision]) -> None:
        scaled = {d.model for d in decisions}
        for model in self._scaled - scaled:  # no longer scaled: its series go
            self.replicas.remove(model, "desired")
            self.queue.remove(model)
        for d in decisions:
            if d.changed:
                self.scale_changes.labels(d.model, d.reason).inc()
            self.replicas.labels(d.model, "desired").set(d.desired)
            self.queue.labels(d.model).set(d.load.waiting)
        self._scaled = scaled

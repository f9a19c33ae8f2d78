"""Scheduler gRPC servicer: protobuf <-> endpoint table."""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter

from llmesh.errors import InvalidArgument, PermissionDenied
from llmesh.rpc.identity import caller
from llmesh.convert import (hardware_from_pb, hardware_to_pb, kv_event_from_pb, kv_hash_from_pb, kv_hash_to_pb,
                            self_test_from_pb, self_test_to_pb)
from llmesh.types import Hardware
from llmesh.v1 import engine_pb2, scheduler_pb2, scheduler_pb2_grpc
from llmesh.scheduler.autoscale import FleetScaler
from llmesh.scheduler.health import NodeSignals
from llmesh.scheduler.kvfeed import KvChangeLog
from llmesh.scheduler.kvindex import KvIndex
from llmesh.scheduler.placement import Ask, node_of, plan
from llmesh.scheduler.reporters import ReportGuard
from llmesh.scheduler.table import EndpointState, EndpointTable, Load, Served

log = logging.getLogger("llmesh.scheduler")


class HardwareForms:
    """Each engine's hardware profile as last reported, as a domain value and as protobuf:
    engines repeat it in every report (up to 20 a second) and every endpoint table sent
    carries it, so an unchanged profile is converted neither way again."""

    def __init__(self):
        self._last: dict[str, tuple[scheduler_pb2.HardwareProfile, Hardware]] = {}

    def domain(self, endpoint_id: str, pb: scheduler_pb2.HardwareProfile) -> Hardware:
        last = self._last.get(endpoint_id)
        if last is not None and last[0] == pb:
            return last[1]
        kept = scheduler_pb2.HardwareProfile()
        kept.CopyFrom(pb)
        hardware = hardware_from_pb(pb)
        self._last[endpoint_id] = (kept, hardware)
        return hardware

    def pb(self, endpoint_id: str, hardware: Hardware) -> scheduler_pb2.HardwareProfile:
        last = self._last.get(endpoint_id)
        return last[0] if last is not None and last[1] is hardware else hardware_to_pb(hardware)

    def forget(self, endpoint_id: str) -> None:
        self._last.pop(endpoint_id, None)


def state_from_report(r: scheduler_pb2.EngineReport, now: float, hardware: Hardware) -> EndpointState:
    """``hardware``: the report's, already converted (``HardwareForms.domain``)."""
    self_test = self_test_from_pb(r.self_test)
    tested_ok = self_test.ok or not self_test.checked_unix  # not run yet: no verdict
    return EndpointState(
        endpoint_id=r.endpoint_id, address=r.address, backend=r.backend, models=tuple(r.models),
        load=Load(running=r.load.running, waiting=r.load.waiting,
                  max_running=r.load.max_running, max_waiting=r.load.max_waiting),
        draining=r.draining, last_report=now, self_test_ok=tested_ok,
        signals=NodeSignals(ecc_errors=sum(g.ecc_corrected + g.ecc_uncorrected for g in hardware.gpus),
                            self_test_ok=tested_ok, self_test_detail=self_test.detail,
                            latency_ms=self_test.latency_ms),
        hardware=hardware, self_test=self_test,
        served=tuple(Served(m.name, m.context_length, m.base_model, m.in_flight, m.embeddings, m.tools)
                     for m in r.served),
        replica_gpus=r.replica_gpus)


def served_pb(s: Served) -> scheduler_pb2.ServedModel:
    return scheduler_pb2.ServedModel(name=s.name, context_length=s.context_length, base_model=s.base_model,
                                     in_flight=s.in_flight, embeddings=s.embeddings, tools=s.tools)


def table_pb(table: EndpointTable, now: float, kv: KvIndex, forms: HardwareForms) -> scheduler_pb2.EndpointTable:
    return scheduler_pb2.EndpointTable(version=table.version, endpoints=[
        scheduler_pb2.Endpoint(
            endpoint_id=e.endpoint_id, address=e.address, backend=e.backend, models=list(e.models),
            load=engine_pb2.EngineLoad(running=e.load.running, waiting=e.load.waiting,
                                       max_running=e.load.max_running, max_waiting=e.load.max_waiting),
            healthy=e.healthy, degraded=e.degraded, last_report_age_s=round(now - e.last_report, 3),
            hardware=forms.pb(e.endpoint_id, e.hardware) if e.hardware is not None else None,
            self_test=self_test_to_pb(e.self_test) if e.self_test is not None else None,
            kv_blocks=kv.count(e.endpoint_id), kv_hash=kv_hash_to_pb(kv.scheme(e.endpoint_id)),
            served=[served_pb(s) for s in e.served])
        for e in table.snapshot()])


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, table: EndpointTable, reports: Counter, kv: KvIndex | None = None,
                 scaler: FleetScaler | None = None):
        self._table = table
        self._scaler = scaler
        self._reports = reports
        self.kv = kv if kv is not None else KvIndex()
        self.kv_changes = KvChangeLog()
        self._hardware = HardwareForms()
        self._guard = ReportGuard()

    async def Report(self, request_iterator, context):
        endpoint_id = None
        who, peer, stream = caller.get(), context.peer(), object()
        try:
            async for report in request_iterator:
                self._guard.check(who, peer, report.endpoint_id, report.address)
                if endpoint_id is None:
                    if who is not None:
                        self._guard.claim(report.endpoint_id, self._guard.owner(who, peer), stream)
                    endpoint_id = report.endpoint_id
                    log.info("engine registered", extra={"endpoint_id": endpoint_id, "address": report.address})
                elif report.endpoint_id != endpoint_id:
                    raise PermissionDenied(f"this stream reports {endpoint_id!r}, not {report.endpoint_id!r}",
                                           reason="not_your_endpoint")
                self._reports.inc()
                if report.HasField("kv_hash"):
                    self.kv.set_scheme(endpoint_id, kv_hash_from_pb(report.kv_hash))
                events = [kv_event_from_pb(e) for e in report.kv_events]
                if events:
                    self.kv.apply(endpoint_id, events)
                    self.kv_changes.record(endpoint_id, events)
                # KV changes alone are news too: gateways pick on them
                state = state_from_report(report, time.monotonic(), self._hardware.domain(endpoint_id, report.hardware))
                await self._table.upsert(state, changed=bool(events))
        finally:
            if endpoint_id is not None:
                self._guard.release(endpoint_id, stream)
                self.kv.forget(endpoint_id)
                self.kv_changes.forget(endpoint_id)
                self._hardware.forget(endpoint_id)
                await self._table.remove(endpoint_id)
                log.info("engine deregistered", extra={"endpoint_id": endpoint_id})
        return scheduler_pb2.ReportAck()

    async def WatchEndpoints(self, request, context):
        version, cursor = -1, None
        while True:
            version = await self._table.wait_for_change(version)
            msg = table_pb(self._table, time.monotonic(), self.kv, self._hardware)
            changes = self.kv_changes.since(cursor) if cursor is not None else None
            if changes is None:  # first message, or this watcher fell behind the log: everything
                cursor = self.kv_changes.cursor
                msg.kv.extend(scheduler_pb2.KvBlocks(endpoint_id=e.endpoint_id, resync=True,
                                                     stored=self.kv.held(e.endpoint_id))
                              for e in self._table.snapshot())
            else:
                deltas, cursor = changes
                msg.kv.extend(scheduler_pb2.KvBlocks(endpoint_id=eid, resync=d.resync, stored=d.stored,
                                                     removed=d.removed) for eid, d in deltas.items())
            yield msg

    async def ListEndpoints(self, request, context):
        return table_pb(self._table, time.monotonic(), self.kv, self._hardware)

    async def Place(self, request, context):
        ask = Ask(model=request.model, replicas=request.replicas, memory_bytes=request.memory_bytes,
                  gpus=request.gpus_per_replica, backends=frozenset(request.backends),
                  avoid_models=frozenset(request.avoid_models))
        nodes = [n for n in map(node_of, self._table.snapshot()) if n is not None]
        return scheduler_pb2.PlaceResponse(placements=[
            scheduler_pb2.Placement(endpoint_id=s.node.endpoint_id, address=s.node.address,
                                    already_serving=s.already_serving) for s in plan(nodes, ask)])

    async def ReportDemand(self, request, context):
        if not request.gateway_id:
            raise InvalidArgument("name the reporting gateway", param="gateway_id")
        if any(not h.model for h in request.held):
            raise InvalidArgument("every held entry names its model", param="held.model")
        if self._scaler is not None:
            now = time.monotonic()
            self._scaler.demand.report(request.gateway_id, {h.model: (h.count, h.oldest_wait_s)
                                                            for h in request.held}, now)
            self._scaler.tick(now)  # scale from zero without waiting for the next round
        return scheduler_pb2.ReportDemandResponse()

    async def GetScale(self, request, context):
        decisions = self._scaler.decisions.values() if self._scaler is not None else ()
        return scheduler_pb2.GetScaleResponse(models=[scheduler_pb2.ModelScale(
            model=d.model, desired=d.desired, ready=d.load.ready, waiting=d.load.waiting, running=d.load.running,
            reason=d.reason) for d in decisions])

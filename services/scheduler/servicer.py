"""Scheduler gRPC servicer: protobuf <-> endpoint table."""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter

from llmesh.convert import kv_event_from_pb, kv_hash_from_pb, kv_hash_to_pb
from llmesh.v1 import engine_pb2, scheduler_pb2, scheduler_pb2_grpc
from llmesh.scheduler.kvindex import KvIndex
from llmesh.scheduler.table import EndpointState, EndpointTable, Load

log = logging.getLogger("llmesh.scheduler")


def state_from_report(r: scheduler_pb2.EngineReport, now: float) -> EndpointState:
    return EndpointState(
        endpoint_id=r.endpoint_id, address=r.address, backend=r.backend, models=tuple(r.models),
        load=Load(running=r.load.running, waiting=r.load.waiting,
                  max_running=r.load.max_running, max_waiting=r.load.max_waiting),
        draining=r.draining, last_report=now,
        self_test_ok=r.self_test.ok or not r.self_test.checked_unix,  # not run yet: no verdict
        details=(r.hardware, r.self_test))


def table_pb(table: EndpointTable, now: float, kv: KvIndex | None = None) -> scheduler_pb2.EndpointTable:
    return scheduler_pb2.EndpointTable(version=table.version, endpoints=[
        scheduler_pb2.Endpoint(
            endpoint_id=e.endpoint_id, address=e.address, backend=e.backend, models=list(e.models),
            load=engine_pb2.EngineLoad(running=e.load.running, waiting=e.load.waiting,
                                       max_running=e.load.max_running, max_waiting=e.load.max_waiting),
            healthy=e.healthy, last_report_age_s=round(now - e.last_report, 3),
            hardware=e.details[0] if e.details else None, self_test=e.details[1] if e.details else None,
            kv_blocks=kv.count(e.endpoint_id) if kv is not None else 0,
            kv_hash=kv_hash_to_pb(kv.scheme(e.endpoint_id)) if kv is not None else None)
        for e in table.snapshot()])


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, table: EndpointTable, reports: Counter, kv: KvIndex | None = None):
        self._table = table
        self._reports = reports
        self.kv = kv if kv is not None else KvIndex()

    async def Report(self, request_iterator, context):
        endpoint_id = None
        try:
            async for report in request_iterator:
                if endpoint_id is None:
                    endpoint_id = report.endpoint_id
                    log.info("engine registered", extra={"endpoint_id": endpoint_id, "address": report.address})
                self._reports.inc()
                if report.HasField("kv_hash"):
                    self.kv.set_scheme(endpoint_id, kv_hash_from_pb(report.kv_hash))
                if report.kv_events:
                    self.kv.apply(endpoint_id, (kv_event_from_pb(e) for e in report.kv_events))
                await self._table.upsert(state_from_report(report, time.monotonic()))
        finally:
            if endpoint_id is not None:
                self.kv.forget(endpoint_id)
                await self._table.remove(endpoint_id)
                log.info("engine deregistered", extra={"endpoint_id": endpoint_id})
        return scheduler_pb2.ReportAck()

    async def WatchEndpoints(self, request, context):
        version = -1
        while True:
            version = await self._table.wait_for_change(version)
            yield table_pb(self._table, time.monotonic(), self.kv)

    async def ListEndpoints(self, request, context):
        return table_pb(self._table, time.monotonic(), self.kv)

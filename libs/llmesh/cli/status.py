"""``llmesh status``: ask each service of a running mesh how it is."""

from __future__ import annotations

import asyncio

import grpc
import orjson

from llmesh.rpc.channels import insecure_channel
from llmesh.rpc.health import health_status
from llmesh.v1 import modelmgr_pb2, modelmgr_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from llmesh.cli.layout import Layout

SERVICES = ("gateway", "scheduler", "modelmgr", "cache")


async def _endpoints(address: str) -> list[dict]:
    async with insecure_channel(address) as ch:
        try:
            table = await scheduler_pb2_grpc.SchedulerStub(ch).ListEndpoints(
                scheduler_pb2.ListEndpointsRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return []
    return [{"endpoint_id": e.endpoint_id, "address": e.address, "backend": e.backend,
             "models": list(e.models), "healthy": e.healthy, "running": e.load.running,
             "waiting": e.load.waiting, "max_running": e.load.max_running,
             "last_report_age_s": e.last_report_age_s} for e in table.endpoints]


async def _models(address: str) -> list[dict]:
    async with insecure_channel(address) as ch:
        try:
            resp = await modelmgr_pb2_grpc.ModelManagerStub(ch).ListModels(
                modelmgr_pb2.ListModelsRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return []
    return [{"name": m.name, "format": m.format, "size_bytes": m.size_bytes, "sha256": m.sha256,
             "context_length": m.context_length, "source": m.source} for m in resp.models]


async def collect(layout: Layout) -> dict:
    addresses = {s: layout.address(s) for s in SERVICES}
    health = await asyncio.gather(*(health_status(a) for a in addresses.values()))
    endpoints, models = await asyncio.gather(_endpoints(addresses["scheduler"]), _models(addresses["modelmgr"]))
    services = [{"name": s, "address": a, "health": h} for (s, a), h in zip(addresses.items(), health)]
    services += [{"name": e["endpoint_id"], "address": e["address"], "health": await health_status(e["address"])}
                 for e in endpoints]
    return {"gateway_http": layout.http_url, "services": services, "endpoints": endpoints, "models": models}


def render(report: dict, as_json: bool) -> str:
    if as_json:
        return orjson.dumps(report, option=orjson.OPT_INDENT_2).decode()
    lines = [f"gateway HTTP  {report['gateway_http']}", "", "SERVICE            ADDRESS              HEALTH"]
    lines += [f"{s['name']:<18} {s['address']:<20} {s['health']}" for s in report["services"]]
    lines += ["", "ENDPOINT           BACKEND   MODELS                    RUNNING WAITING HEALTHY"]
    lines += [f"{e['endpoint_id']:<18} {e['backend']:<9} {','.join(e['models']):<25} "
              f"{e['running']:>7} {e['waiting']:>7} {'yes' if e['healthy'] else 'no'}" for e in report["endpoints"]]
    lines += ["", "MODEL                     FORMAT  SIZE      CONTEXT  SHA256"]
    lines += [f"{m['name']:<25} {m['format']:<7} {m['size_bytes'] / 2**20:>6.1f}MiB {m['context_length']:>7}  "
              f"{m['sha256'][:16]}" for m in report["models"]]
    return "\n".join(lines)

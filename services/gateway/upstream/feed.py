"""The scheduler's WatchEndpoints stream -> the picker's endpoint table and KV view:
the gateway picks locally and pays no hop to the scheduler per request."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from llmesh.backoff import Backoff
from llmesh.convert import kv_hash_from_pb
from llmesh.discovery.base import Resolver
from llmesh.errors import DiscoveryError
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import Identity
from llmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker
from llmesh.gateway.upstream.rpc import why

log = logging.getLogger("llmesh.gateway.upstreams")


def endpoint_from_pb(e: scheduler_pb2.Endpoint) -> Endpoint:
    return Endpoint(endpoint_id=e.endpoint_id, address=e.address, models=frozenset(e.models),
                    running=e.load.running, waiting=e.load.waiting, max_running=e.load.max_running,
                    max_waiting=e.load.max_waiting,
                    healthy=e.healthy, degraded=e.degraded,
                    kv_hash=kv_hash_from_pb(e.kv_hash) if e.HasField("kv_hash") else None,
                    context={s.name: s.context_length for s in e.served if s.context_length},
                    adapters={s.name: s.in_flight for s in e.served if s.base_model},
                    embeds=frozenset(s.name for s in e.served if s.embeddings),
                    tools=frozenset(s.name for s in e.served if s.tools))


# A restarted scheduler knows no engine until each reports again (their reporters reconnect with
# backoff): for this long after a stream comes back, an engine the last table had and the new one
# lacks is kept as it was last reported, so a scheduler restart never empties the gateways' tables.
RESYNC_S = 10.0


class SchedulerFeed:
    """Keeps the picker's table current from the scheduler's WatchEndpoints stream.
    If the scheduler goes away, the last known table stays in use, and after it is back
    engines it has not heard from again yet stay for ``RESYNC_S``."""

    def __init__(self, resolve: Resolver, picker: EndpointPicker, identity: Identity | None = None,
                 clock: Callable[[], float] = time.monotonic, resync_s: float = RESYNC_S):
        self._resolve = resolve
        self._identity = identity
        self._picker = picker
        self._clock = clock
        self._resync_s = resync_s

    def apply(self, endpoints: list[Endpoint], keep_until: float) -> None:
        """One table from the stream; before ``keep_until``, engines missing from it stay."""
        if self._clock() < keep_until:
            fresh = {e.endpoint_id for e in endpoints}
            endpoints += [e for e in self._picker.all() if e.endpoint_id not in fresh]
        self._picker.replace_all(endpoints)

    async def run(self) -> None:
        backoff = Backoff(initial_s=0.2, max_s=5.0)
        resumed = False  # the first stream starts from an empty table: nothing to keep
        while True:
            address = "?"
            try:
                address = await self._resolve()  # anew on every (re)connect
                async with mesh_channel(address, "scheduler", self._identity) as channel:
                    stub = scheduler_pb2_grpc.SchedulerStub(channel)
                    keep_until = self._clock() + self._resync_s if resumed else 0.0
                    resumed = True
                    async for table in stub.WatchEndpoints(scheduler_pb2.WatchEndpointsRequest()):
                        self.apply([endpoint_from_pb(e) for e in table.endpoints], keep_until)
                        for b in table.kv:
                            self._picker.kv.apply(b.endpoint_id, b.resync, b.stored, b.removed)
                        backoff.reset()
            except (grpc.aio.AioRpcError, DiscoveryError) as exc:
                log.warning("scheduler stream broke; keeping the last endpoint table",
                            extra={"scheduler": address, "error": why(exc)})
            await backoff.sleep()

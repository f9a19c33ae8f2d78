"""Consul discovery (py-consul), a thin adapter over the same interface as etcd:
the agent health-checks each instance over grpc.health.v1 and drops one that stays
critical; watches are blocking queries. py-consul is synchronous, so its calls run
in a worker thread."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import consul

from llmesh.discovery.base import Instance


class ConsulRegistry:
    def __init__(self, address: str = "127.0.0.1:8500", check_interval_s: int = 2,
                 deregister_after_s: int = 10):
        host, _, port = address.rpartition(":")
        self._consul = consul.Consul(host=host or "127.0.0.1", port=int(port))
        self._interval = f"{check_interval_s}s"
        self._deregister_after = f"{deregister_after_s}s"

    async def register(self, instance: Instance) -> None:
        host, _, port = instance.address.rpartition(":")
        check = consul.Check.grpc(instance.address, self._interval, deregister=self._deregister_after)
        await asyncio.to_thread(self._consul.agent.service.register, instance.service,
                                service_id=instance.instance_id, address=host, port=int(port), check=check)

    async def deregister(self, instance: Instance) -> None:
        await asyncio.to_thread(self._consul.agent.service.deregister, instance.instance_id)

    def _instances(self, service: str, nodes: list) -> list[Instance]:
        return [Instance(service, n["Service"]["ID"], f"{n['Service']['Address']}:{n['Service']['Port']}")
                for n in nodes]

    async def resolve(self, service: str) -> list[Instance]:
        _, nodes = await asyncio.to_thread(self._consul.health.service, service, passing=True)
        return self._instances(service, nodes)

    async def watch(self, service: str) -> AsyncIterator[list[Instance]]:
        index = None
        while True:
            index, nodes = await asyncio.to_thread(self._consul.health.service, service, index=index,
                                                   wait="30s", passing=True)
            yield self._instances(service, nodes)

    async def close(self) -> None:
        return None

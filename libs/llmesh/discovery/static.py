"""Static discovery for one machine: the addresses are configuration."""

from __future__ import annotations

from collections.abc import AsyncIterator

from llmesh.discovery.base import Instance


class StaticRegistry:
    def __init__(self, addresses: dict[str, list[str]] | None = None):
        self._instances: dict[str, list[Instance]] = {
            svc: [Instance(svc, f"{svc}-{i}", a) for i, a in enumerate(addrs)]
            for svc, addrs in (addresses or {}).items()}

    async def register(self, instance: Instance) -> None:
        mine = self._instances.setdefault(instance.service, [])
        if instance not in mine:
            mine.append(instance)

    async def deregister(self, instance: Instance) -> None:
        if instance in self._instances.get(instance.service, []):
            self._instances[instance.service].remove(instance)

    async def resolve(self, service: str) -> list[Instance]:
        return list(self._instances.get(service, []))

    async def watch(self, service: str) -> AsyncIterator[list[Instance]]:
        yield await self.resolve(service)

    async def close(self) -> None:
        return None

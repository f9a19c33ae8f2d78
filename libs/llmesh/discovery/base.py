"""The discovery contract every backend implements."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Instance:
    service: str      # "scheduler", "engine", ...
    instance_id: str  # unique per process
    address: str      # host:port of its gRPC server


class Registry(Protocol):
    async def register(self, instance: Instance) -> None:
        """Announce ``instance``; keep it announced until deregistered or this process dies."""

    async def deregister(self, instance: Instance) -> None: ...

    async def resolve(self, service: str) -> list[Instance]:
        """The live instances of ``service`` now (may be empty)."""

    def watch(self, service: str) -> AsyncIterator[list[Instance]]:
        """The live instances now, then again after every change."""

    async def close(self) -> None: ...


class NoInstance(LookupError):
    pass


Resolver = Callable[[], Awaitable[str]]


def resolver(registry: Registry, service: str) -> Resolver:
    """A function that returns an address of a live ``service`` instance, picked anew
    each call (clients call it when they (re)connect)."""
    async def resolve() -> str:
        instances = await registry.resolve(service)
        if not instances:
            raise NoInstance(f"no live '{service}' instance is registered")
        return instances[0].address
    return resolve


def fixed(address: str) -> Resolver:
    async def resolve() -> str:
        return address
    return resolve

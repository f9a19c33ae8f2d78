"""The discovery contract every backend implements, and the resolvers callers use."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmesh.backoff import Backoff
from llmesh.errors import DiscoveryError

log = logging.getLogger("llmesh.discovery")


@dataclass(frozen=True, slots=True)
class Instance:
    service: str      # "scheduler", "engine", ...
    instance_id: str  # unique per process
    address: str      # host:port of its gRPC server, as other hosts reach it
    # The grpc.health.v1 service name a backend's health check asks about ("" = the
    # whole server). Not part of an instance's identity: resolved instances lack it.
    health_name: str = field(default="", compare=False)
    # A plaintext HTTP health endpoint (http://host:port/healthz) for a backend's check to ask
    # instead of grpc.health.v1: set when the gRPC port needs a mesh certificate ("tls" trust).
    health_url: str = field(default="", compare=False)


class Registry(Protocol):
    """Every method raises DiscoveryError, and only that, when the backend fails."""

    async def register(self, instance: Instance) -> None:
        """Announce ``instance``; keep it announced (announce it again if the backend
        lost it) until deregistered or this process dies."""

    async def deregister(self, instance: Instance) -> None: ...

    async def resolve(self, service: str) -> list[Instance]:
        """The live instances of ``service`` now (may be empty)."""

    def watch(self, service: str) -> AsyncIterator[list[Instance]]:
        """The live instances now, then again after every change."""

    async def close(self) -> None: ...


class NoInstance(DiscoveryError, LookupError):
    def __init__(self, service: str, why: str = "is registered"):
        super().__init__(f"no live '{service}' instance {why}")


def unspecified(address: str) -> bool:
    """Whether ``address`` (host:port) names no host: 0.0.0.0, ::, [::] or empty."""
    host = address.rpartition(":")[0].strip("[]")
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a host name


def advertisable(address: str) -> str:
    """``address`` if other hosts can dial it, else ValueError saying why."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"advertise address {address!r} is not host:port")
    if unspecified(address):
        raise ValueError(f"advertise address {address!r} names no host: 0.0.0.0 and :: mean 'every "
                         "interface' to a server and nothing to a client; give the address other hosts "
                         "reach this service at (the pod or container IP, or a DNS name)")
    return address


Resolver = Callable[[], Awaitable[str]]


class Follower:
    """A resolver for one service fed by ``registry.watch`` in a background task: a
    lookup costs no call to the backend, and while the backend is away (or answers
    with errors) the instances it last reported stay in use. Successive lookups take
    the instances in turn, so reconnects spread over them."""

    def __init__(self, registry: Registry, service: str, first_answer_s: float = 2.0,
                 backoff_max_s: float = 5.0):
        self._registry = registry
        self._service = service
        self._first_answer = first_answer_s
        self._backoff_max = backoff_max_s
        self._instances: list[Instance] = []
        self._answered = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None
        self._turn = 0

    @property
    def instances(self) -> list[Instance]:
        return list(self._instances)

    async def __call__(self) -> str:
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name=f"follow-{self._service}")
        if not self._answered.is_set():
            try:
                await asyncio.wait_for(self._answered.wait(), self._first_answer)
            except TimeoutError:
                raise NoInstance(self._service, "known yet: discovery has not answered") from None
        if not self._instances:
            raise NoInstance(self._service)
        self._turn += 1
        return self._instances[self._turn % len(self._instances)].address

    async def _follow(self) -> None:
        backoff = Backoff(initial_s=0.2, max_s=self._backoff_max)
        while True:
            try:
                async for instances in self._registry.watch(self._service):
                    self._instances = list(instances)
                    self._answered.set()
                    backoff.reset()
                wait = backoff.next()  # a watch that ended (backend restarted): start over
            except DiscoveryError as exc:
                wait = backoff.next()
                log.warning("discovery watch failed; keeping the last known instances",
                            extra={"service": self._service, "error": str(exc), "retry_in_s": wait,
                                   "instances": len(self._instances)})
            await asyncio.sleep(wait)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def fixed(address: str) -> Resolver:
    async def resolve() -> str:
        return address
    return resolve

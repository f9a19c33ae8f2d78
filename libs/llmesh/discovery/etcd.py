"""etcd discovery (aetcd): each instance is a key under ``<prefix>/<service>/`` bound
to a lease that this process keeps alive. A process that dies stops refreshing,
so its key disappears when the lease's TTL runs out. Failures are raised as
DiscoveryError."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aetcd
import aetcd.exceptions
import grpc
import orjson

from llmesh.backoff import Backoff
from llmesh.discovery.base import Instance, advertisable
from llmesh.errors import DiscoveryError

log = logging.getLogger("llmesh.discovery.etcd")


def etcd_client(address: str, timeout_s: int = 5) -> aetcd.Client:
    host, _, port = address.rpartition(":")
    return aetcd.Client(host=host or "127.0.0.1", port=int(port), timeout=timeout_s)


@contextlib.contextmanager
def _failures(what: str) -> Iterator[None]:
    try:
        yield
    except (aetcd.exceptions.ClientError, grpc.aio.AioRpcError, OSError, TimeoutError) as exc:
        raise DiscoveryError(f"etcd {what} failed: {type(exc).__name__}: {exc}") from None


class EtcdRegistry:
    def __init__(self, client: aetcd.Client, prefix: str = "/llmesh/services", ttl_s: int = 5):
        self._client = client
        self._prefix = prefix.rstrip("/")
        self._ttl = ttl_s
        self._keepers: dict[Instance, asyncio.Task[Any]] = {}

    def _key(self, instance: Instance) -> bytes:
        return f"{self._prefix}/{instance.service}/{instance.instance_id}".encode()

    def _service_prefix(self, service: str) -> bytes:
        return f"{self._prefix}/{service}/".encode()

    async def _announce(self, instance: Instance) -> int:
        lease = await self._client.lease(self._ttl)
        value = orjson.dumps({"address": instance.address, "instance_id": instance.instance_id})
        await self._client.put(self._key(instance), value, lease=lease)
        lease_id: int = lease.id
        return lease_id

    async def register(self, instance: Instance) -> None:
        try:
            advertisable(instance.address)
        except ValueError as exc:
            raise DiscoveryError(f"cannot register {instance.service}: {exc}") from None
        with _failures("register"):
            lease_id = await self._announce(instance)
        self._keepers[instance] = asyncio.create_task(self._keep_alive(instance, lease_id),
                                                      name=f"lease-{instance.instance_id}")

    async def _keep_alive(self, instance: Instance, lease_id: int) -> None:
        """Refresh at a third of the TTL; if etcd was away long enough for the lease
        to lapse, announce again with a new one."""
        backoff = Backoff(initial_s=min(0.2, self._ttl), max_s=self._ttl)
        while True:
            await asyncio.sleep(self._ttl / 3)
            try:
                info = await self._client.get_lease_info(lease_id, keys=False)
                if info.TTL <= 0:
                    lease_id = await self._announce(instance)
                    log.info("re-registered after the lease lapsed", extra={"service": instance.service})
                else:
                    await self._client.refresh_lease(lease_id)
                backoff.reset()
            except Exception as exc:  # noqa: BLE001 - etcd away: keep serving, keep trying
                wait = backoff.next()
                log.warning("etcd unreachable; registration not refreshed",
                            extra={"error": type(exc).__name__, "retry_in_s": wait})
                await asyncio.sleep(wait)

    async def deregister(self, instance: Instance) -> None:
        task = self._keepers.pop(instance, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with _failures("deregister"):
            await self._client.delete(self._key(instance))

    async def resolve(self, service: str) -> list[Instance]:
        with _failures("read"):
            result = await self._client.get_prefix(self._service_prefix(service))
        out = []
        for kv in result:
            data = orjson.loads(kv.value)
            out.append(Instance(service, data["instance_id"], data["address"]))
        return out

    async def watch(self, service: str) -> AsyncIterator[list[Instance]]:
        with _failures("watch"):  # bounded: with etcd away, creating a watch would wait on
            watch = await asyncio.wait_for(self._client.watch_prefix(self._service_prefix(service)), 5)
        try:
            yield await self.resolve(service)
            with _failures("watch"):
                async for _event in watch:
                    yield await self.resolve(service)
        finally:
            with contextlib.suppress(Exception):
                await watch.cancel()

    async def close(self) -> None:
        for instance in list(self._keepers):
            with contextlib.suppress(Exception):
                await self.deregister(instance)

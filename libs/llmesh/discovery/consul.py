"""Consul discovery, a thin adapter over py-consul's asyncio client (aiohttp) behind
the same interface as etcd. The agent health-checks each instance over
grpc.health.v1 (asking about the instance's own gRPC service, with a timeout shorter
than the interval), or in "tls" trust over the plaintext /healthz of its metrics port,
and reads use the passing-only filter, so an instance that stops
serving leaves routing within a check interval or two. Watches are blocking queries
run as coroutines: cancelling one ends it at once, no thread is left waiting.

Every failure (agent unreachable, no leader, ACL refusal, bad request) is raised as
DiscoveryError. Registrations are checked against the agent every ``resync_s`` and
registered again if an agent restart lost them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import consul
import consul.aio

from llmesh.backoff import Backoff
from llmesh.discovery.base import Instance, advertisable
from llmesh.errors import DiscoveryError

log = logging.getLogger("llmesh.discovery.consul")


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def parse_address(address: str) -> tuple[str, str, int]:
    """``host:port``, ``http://host:port`` or ``https://host:port`` -> (scheme, host, port)."""
    parts = urlsplit(address if "://" in address else f"http://{address}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"Consul address {address!r} is not [http[s]://]host[:port]")
    return parts.scheme, parts.hostname, parts.port or (8501 if parts.scheme == "https" else 8500)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ConsulRegistry:
    def __init__(self, address: str = "127.0.0.1:8500", *, token: str | None = None,
                 ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                 check_interval_s: float = 2.0, check_timeout_s: float = 1.0, deregister_after_s: int = 60,
                 wait_s: float = 30.0, resync_s: float = 5.0, min_query_gap_s: float = 0.1,
                 call_timeout_s: float = 5.0, backoff_max_s: float = 5.0):
        self._scheme, self._host, self._port = parse_address(address)
        self._where = f"{self._scheme}://{_join(self._host, self._port)}"
        # py-consul lets CONSUL_HTTP_TOKEN override an explicit token; here the setting wins.
        self._token = token or os.environ.get("CONSUL_HTTP_TOKEN") or None
        self._verify: bool | str = ca_file or True
        self._cert = (cert_file, key_file) if cert_file else None
        self._interval = _duration(check_interval_s)
        self._check_timeout = _duration(min(check_timeout_s, check_interval_s))
        self._deregister_after = _duration(max(deregister_after_s, 60))  # Consul's own floor
        self._wait = wait_s
        self._resync = resync_s
        self._min_gap = min_query_gap_s
        self._call_timeout = call_timeout_s
        self._backoff_max = backoff_max_s
        self._client: consul.aio.Consul | None = None
        self._registered: dict[str, Instance] = {}
        self._keeper: asyncio.Task[Any] | None = None

    def _consul(self) -> consul.aio.Consul:
        if self._client is None:  # built in the running loop: aiohttp sessions belong to one
            self._client = consul.aio.Consul(host=self._host, port=self._port, scheme=self._scheme,
                                             verify=self._verify, cert=self._cert)
            self._client.token = self._token
        return self._client

    async def _call(self, what: str, call: Awaitable[Any], timeout: float | None = None) -> Any:
        try:
            async with asyncio.timeout(timeout or self._call_timeout):
                return await call
        except consul.ConsulException as exc:  # 4xx/5xx: BadRequest, ACLPermissionDenied, 500 no leader
            raise DiscoveryError(f"consul {what} at {self._where} failed: {type(exc).__name__}: {exc}") from None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise DiscoveryError(f"consul {what} at {self._where} failed: {type(exc).__name__}: {exc}") from None

    async def register(self, instance: Instance) -> None:
        try:
            advertisable(instance.address)
        except ValueError as exc:
            raise DiscoveryError(f"cannot register {instance.service}: {exc}") from None
        await self._register(instance)
        self._registered[instance.instance_id] = instance
        if self._keeper is None:
            self._keeper = asyncio.create_task(self._keep_registered(), name="consul-resync")

    async def _register(self, instance: Instance) -> None:
        host, _, port = instance.address.rpartition(":")
        await self._call("register", self._consul().agent.service.register(
            instance.service, service_id=instance.instance_id, address=host.strip("[]"), port=int(port),
            check=self._check(instance)))

    def _check(self, instance: Instance) -> dict[str, Any]:
        """The instance's health check (developer.hashicorp.com/consul/docs/services/usage/checks).
        With a ``health_url`` (mutual TLS on the gRPC port, which Consul's gRPC check cannot
        pass: it has no mesh certificate) an HTTP check: a GET of the URL every Interval, 2xx
        passing, 429 warning, anything else (503 NOT_SERVING, no answer within Timeout)
        critical. Otherwise a gRPC check: it dials "host:port/service" and asks grpc.health.v1
        about that service. Either way a NOT_SERVING instance drops out of passing reads."""
        check: dict[str, Any]
        if instance.health_url:
            check = consul.Check.http(instance.health_url, self._interval, timeout=self._check_timeout,
                                      deregister=self._deregister_after)
        else:
            target = f"{instance.address}/{instance.health_name}" if instance.health_name else instance.address
            check = consul.Check.grpc(target, self._interval, timeout=self._check_timeout,
                                      deregister=self._deregister_after)
        return check

    async def _keep_registered(self) -> None:
        """An agent that restarts without its state (dev mode, a lost data dir) forgets
        us; register again whatever it no longer lists."""
        while True:
            await asyncio.sleep(self._resync)
            try:
                known = await self._call("list services", self._consul().agent.services())
                for instance in list(self._registered.values()):
                    if instance.instance_id not in (known or {}):
                        await self._register(instance)
                        log.info("re-registered: the agent had lost this instance",
                                 extra={"service": instance.service, "instance": instance.instance_id})
            except DiscoveryError as exc:
                log.warning("cannot check registrations against the agent", extra={"error": str(exc)})

    async def deregister(self, instance: Instance) -> None:
        self._registered.pop(instance.instance_id, None)
        await self._call("deregister", self._consul().agent.service.deregister(instance.instance_id))

    @staticmethod
    def _instances(service: str, nodes: list[Any] | None) -> list[Instance]:
        out = []
        for n in nodes or []:
            svc = n["Service"]
            # An empty service address means "the node's address" (api-docs/agent/service, Address).
            host = svc.get("Address") or n["Node"]["Address"]
            out.append(Instance(service, svc["ID"], _join(host, svc["Port"])))
        return sorted(out, key=lambda i: i.instance_id)

    async def resolve(self, service: str) -> list[Instance]:
        _, nodes = await self._call("health query", self._consul().health.service(service, passing=True))
        return self._instances(service, nodes)

    async def watch(self, service: str) -> AsyncIterator[list[Instance]]:
        """Blocking queries, following Consul's implementation notes (api-docs/features/
        blocking): an answer is no proof of change, so only a changed list is yielded;
        an index that goes backwards restarts from 0, one below 1 becomes 1; queries
        start at most every ``min_query_gap_s``; failures retry with backoff."""
        loop = asyncio.get_running_loop()
        index, last, started = 0, None, -1e9
        backoff = Backoff(initial_s=0.2, max_s=self._backoff_max)
        while True:
            await asyncio.sleep(max(0.0, started + self._min_gap - loop.time()))
            started = loop.time()
            try:
                answer_index, nodes = await self._call(
                    "watch", self._consul().health.service(service, index=index or None, wait=_duration(self._wait),
                                                           passing=True),
                    timeout=self._wait * 17 / 16 + self._call_timeout)
                new = int(answer_index)
            except (DiscoveryError, ValueError) as exc:  # ValueError: a garbled X-Consul-Index
                wait = backoff.next()
                log.warning("consul watch failed; retrying", extra={"service": service, "error": str(exc),
                                                                    "retry_in_s": wait})
                await asyncio.sleep(wait)
                index = 0  # the agent may have restarted: ask for the current state first
                continue
            backoff.reset()
            index = 0 if new < index else max(new, 1)
            instances = self._instances(service, nodes)
            if instances != last:
                last = instances
                yield instances

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        if self._client is not None:
            await self._client.close()
            self._client = None

"""Runs one service process: logging, platform (discovery, live config, metrics),
start, registration, signals, drain, graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import uvloop

from llmesh.backoff import Backoff
from llmesh.discovery.base import Instance, unspecified
from llmesh.liveconfig.live import ConfigUnavailable
from llmesh.logs import setup_logging
from llmesh.metrics_http import start_metrics
from llmesh.orphans import die_with_launcher
from llmesh.platform import Platform, build_platform
from llmesh.settings import MeshSettings, ServiceSettings
from llmesh.discovery.base import Registry

log = logging.getLogger("llmesh.service")
S = TypeVar("S", bound=ServiceSettings)
# A worker drains within grace_s and then closes its clients; past this margin its supervisor
# kills it, still inside what `llmesh up` (grace + 2 s) and the Helm chart (grace + 5 s) give a service.
STOP_MARGIN_S = 1.5
# Past grace_s + this after its stop began, a process ends itself (exit 1). A stop that hangs (a
# task that swallows its cancellation, an executor thread blocked in a read that asyncio.run's
# teardown waits for) would otherwise run on where nobody is left to kill it: a worker, or a
# service under `llmesh up`, whose parent was SIGKILLed gets SIGTERM from the kernel
# (PR_SET_PDEATHSIG) and no SIGKILL after it. Later than the supervisor's and `llmesh up`'s kill,
# no later than Kubernetes' (grace + 5 s in the charts).
STOP_DEADLINE_MARGIN_S = 4.0


def exit_if_stop_overruns(after_s: float) -> threading.Timer:
    """Ends this process with status 1 (logged) unless it has exited within ``after_s``."""
    def overran() -> None:
        log.error("stop overran its deadline; exiting", extra={"after_s": after_s})
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(after_s, overran)
    timer.daemon = True  # never holds up an exit that comes in time
    timer.start()
    return timer


class App(Protocol):
    @property
    def advertise_address(self) -> str:
        """The address the server is bound to (a setting may name another to advertise)."""

    @property
    def health_service(self) -> str:
        """The grpc.health.v1 service name discovery's health check asks about."""

    async def start(self) -> None: ...
    async def stop(self, grace: float) -> None: ...


class StartFailed(RuntimeError):
    pass


async def _register(registry: Registry, instance: Instance, backend: str) -> None:
    """Register, retrying with backoff while the registry is away: the service
    serves meanwhile and appears in discovery once the backend is back."""
    backoff = Backoff(initial_s=0.5, max_s=10.0)
    while True:
        try:
            await asyncio.wait_for(registry.register(instance), 5)
            return
        except Exception as exc:  # noqa: BLE001 - any way of the registry being away or refusing
            wait = backoff.next()
            log.warning("cannot register; retrying", extra={"backend": backend, "retry_in_s": wait,
                                                            "error": f"{type(exc).__name__}: {exc}"})
            await asyncio.sleep(wait)


def _env_name(name: str) -> str:
    return f"LLMESH_{name.upper()}_ADVERTISE_ADDRESS"


def check_advertisable(name: str, settings: ServiceSettings, mesh: MeshSettings) -> None:
    if mesh.discovery != "static" and settings.advertise_address is None and unspecified(settings.address):
        raise StartFailed(f"{name} listens on {settings.address}, which names no host other services can dial; "
                          f"set {_env_name(name)} to the address they reach it at (e.g. the pod IP and port)")


def check_health_endpoint(name: str, settings: ServiceSettings, mesh: MeshSettings) -> None:
    """In "tls" trust Consul checks the metrics port's plaintext /healthz (its gRPC check has no
    mesh certificate): a service without a metrics port would stay critical, so it does not start."""
    if mesh.discovery == "consul" and mesh.trust == "tls" and settings.metrics_port is None:
        raise StartFailed(f"{name} runs in LLMESH_TRUST=tls with Consul discovery: Consul cannot present a mesh "
                          "certificate to its gRPC port, so it checks http://<host>:<metrics port>/healthz instead; "
                          f"set LLMESH_{name.upper()}_METRICS_PORT")


def health_url(address: str, mesh: MeshSettings, metrics_port: int | None) -> str:
    """What discovery's check asks in "tls" trust: /healthz on the metrics port, at the host of the
    advertised ``address``; "" (grpc.health.v1 on ``address``) in the other trusts."""
    if mesh.trust != "tls" or metrics_port is None:
        return ""
    return f"http://{address.rpartition(':')[0]}:{metrics_port}/healthz"


class Registration:
    """One instance of a service in discovery, from start until ``end``: registered in the
    background (retrying while the registry is away), deregistered first thing on stop."""

    def __init__(self, name: str, registry: Registry, mesh: MeshSettings, address: str, health_service: str,
                 metrics_port: int | None = None):
        """``metrics_port``: the port serving /healthz (llmesh.metrics_http), if any."""
        self.instance = Instance(name, f"{name}-{socket.gethostname()}-{os.getpid()}", address, health_service,
                                 health_url(address, mesh, metrics_port))
        self._registry = registry
        backend = {"etcd": mesh.etcd_address, "consul": mesh.consul_address}.get(mesh.discovery, "static")
        self._task = asyncio.create_task(_register(registry, self.instance, backend))

    async def end(self) -> None:
        self._task.cancel()
        with contextlib.suppress(Exception):  # deregister first: no new work is routed here
            await asyncio.wait_for(self._registry.deregister(self.instance), 2)


@dataclass(frozen=True)
class Worker:
    """This process is worker ``index`` of several sharing the service's ports under a
    supervisor (llmesh.workers), which registers the one instance in discovery and serves
    the merged /metrics; ``ready`` is called once the app serves."""
    index: int
    ready: Callable[[], None]


async def serve(name: str, build: Callable[[Platform], App], settings: ServiceSettings, mesh: MeshSettings,
                worker: Worker | None = None) -> None:
    """Build and start the app; register it at its advertise address; on SIGTERM or
    SIGINT deregister first, then give in-flight work ``grace_s`` seconds. The app is
    built inside the loop so it may create channels."""
    check_advertisable(name, settings, mesh)
    check_health_endpoint(name, settings, mesh)
    grace = settings.grace_s
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    platform = build_platform(name, mesh)
    try:
        await platform.config.start()
    except ConfigUnavailable as exc:
        raise StartFailed(str(exc)) from exc
    metrics_server = None
    if settings.metrics_port is not None and worker is None:
        metrics_server = await start_metrics(platform.metrics, settings.host, settings.metrics_port,
                                             settings.bind_wait_s, platform.serving)
    app = build(platform)
    await app.start()
    heartbeat = asyncio.create_task(platform.serving.heartbeat())  # /healthz sees a stalled loop
    registration = None
    if worker is None:
        registration = Registration(name, platform.registry, mesh, settings.advertise_address or app.advertise_address,
                                    app.health_service, metrics_server.server_port if metrics_server else None)
    else:
        worker.ready()
    await stopping.wait()
    log.info("stopping", extra={"grace_s": grace})
    exit_if_stop_overruns(grace + STOP_DEADLINE_MARGIN_S)
    if registration is not None:
        await registration.end()
    await app.stop(grace)
    heartbeat.cancel()
    await platform.config.stop()
    await platform.close()  # watches and registry keepers end here, none left blocking the exit
    if metrics_server is not None:
        metrics_server.shutdown()
    platform.tracing.shutdown()  # flush spans still queued
    log.info("stopped")


def run(name: str, settings: S, build: Callable[[S, Platform], App],
        worker: Worker | None = None) -> None:
    die_with_launcher()
    setup_logging(name, settings.log_level, {"worker": worker.index} if worker else None)
    main = serve(name, lambda platform: build(settings, platform), settings, MeshSettings(), worker)
    try:
        if settings.event_loop == "uvloop":
            # ~15% less CPU per wake-up here, and 0.3-2 ms less added TTFT (bench/gateway.py).
            uvloop.run(main)
        else:
            asyncio.run(main)
    except (OSError, StartFailed) as exc:
        log.error("cannot start", extra={"error": str(exc)})
        raise SystemExit(1) from exc

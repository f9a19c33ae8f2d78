"""Runs one service process: logging, platform (discovery, live config, metrics),
start, registration, signals, drain, graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import Protocol

import uvloop

from llmesh.discovery.base import Instance
from llmesh.liveconfig.live import ConfigUnavailable
from llmesh.logs import setup_logging
from llmesh.platform import Platform, build_platform
from llmesh.settings import MeshSettings, ServiceSettings

log = logging.getLogger("llmesh.service")


class App(Protocol):
    @property
    def advertise_address(self) -> str: ...
    async def start(self) -> None: ...
    async def stop(self, grace: float) -> None: ...


class StartFailed(RuntimeError):
    pass


async def serve(name: str, build: Callable[[Platform], App], grace: float, mesh: MeshSettings) -> None:
    """Build and start the app; register it; on SIGTERM or SIGINT deregister first,
    then give in-flight work ``grace`` seconds. The app is built inside the loop so
    it may create channels."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    platform = build_platform(name, mesh)
    try:
        await platform.config.start()
    except ConfigUnavailable as exc:
        raise StartFailed(str(exc)) from exc
    app = build(platform)
    await app.start()
    instance = Instance(name, f"{name}-{socket.gethostname()}-{os.getpid()}", app.advertise_address)
    try:
        await asyncio.wait_for(platform.registry.register(instance), 5)
    except Exception as exc:  # noqa: BLE001 - any way of the registry being away
        await app.stop(0)
        raise StartFailed(f"cannot register with {mesh.discovery} discovery "
                          f"({mesh.etcd_address if mesh.discovery == 'etcd' else mesh.consul_address}): "
                          f"{type(exc).__name__}: {exc}") from exc
    await stopping.wait()
    log.info("stopping", extra={"grace_s": grace})
    with contextlib.suppress(Exception):
        await asyncio.wait_for(platform.registry.deregister(instance), 2)
    await app.stop(grace)
    await platform.config.stop()
    with contextlib.suppress(Exception):
        await platform.registry.close()
    log.info("stopped")


def run(name: str, settings: ServiceSettings, build: Callable[[ServiceSettings, Platform], App]) -> None:
    setup_logging(name, settings.log_level)
    main = serve(name, lambda platform: build(settings, platform), settings.grace_s, MeshSettings())
    try:
        if settings.event_loop == "uvloop":
            # ~15% less CPU per wake-up here, and 0.3-2 ms less added TTFT (bench/gateway.py).
            uvloop.run(main)
        else:
            asyncio.run(main)
    except (OSError, StartFailed) as exc:
        log.error("cannot start", extra={"error": str(exc)})
        raise SystemExit(1) from exc

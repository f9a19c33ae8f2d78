"""Runs one service process: logging, signals, start, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Protocol

import uvloop

from llmesh.logs import setup_logging
from llmesh.settings import ServiceSettings

log = logging.getLogger("llmesh.service")


class App(Protocol):
    async def start(self) -> None: ...
    async def stop(self, grace: float) -> None: ...


async def serve(build: Callable[[], App], grace: float) -> None:
    """Build and start the app; on SIGTERM or SIGINT stop it, giving in-flight work
    ``grace`` seconds. The app is built inside the loop so it may create channels."""
    loop = asyncio.get_running_loop()
    app = build()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await app.start()
    await stopping.wait()
    log.info("stopping", extra={"grace_s": grace})
    await app.stop(grace)
    log.info("stopped")


def run(name: str, settings: ServiceSettings, build: Callable[[ServiceSettings], App]) -> None:
    setup_logging(name, settings.log_level)
    try:
        main = serve(lambda: build(settings), settings.grace_s)
        if settings.event_loop == "uvloop":
            # ~15% less CPU per wake-up here, and 0.3-2 ms less added TTFT (bench/gateway.py).
            uvloop.run(main)
        else:
            asyncio.run(main)
    except OSError as exc:
        log.error("cannot start", extra={"error": str(exc)})
        raise SystemExit(1) from exc

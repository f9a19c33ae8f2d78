"""The config a service runs on: the last valid document. New documents are validated
as a whole (the schema, then the service's own checks: rules that need its settings,
such as the gateway's provider key directory); an invalid one is rejected (log line +
llmesh_config_rejected_total) and the last good one stays. Each good one is also saved
as a local snapshot, so a service can start while the backend is down."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from llmesh.backoff import Backoff
from llmesh.liveconfig.document import InvalidConfig, parse
from llmesh.liveconfig.schema import MeshConfig
from llmesh.liveconfig.stores import ConfigStore, Version

log = logging.getLogger("llmesh.liveconfig")


class ConfigUnavailable(RuntimeError):
    pass


Check = Callable[[MeshConfig], None]  # raises InvalidConfig saying what is wrong


class LiveConfig:
    def __init__(self, store: ConfigStore | None, metrics: CollectorRegistry, service: str,
                 snapshot: Path | None = None, start_timeout_s: float = 3.0):
        self._store = store
        self._snapshot = snapshot
        self._service = service
        self._start_timeout = start_timeout_s
        self.current = MeshConfig()
        self.revision = 0  # of the config in force
        self._seen = 0     # newest revision looked at, valid or not
        self._rejected = Counter("llmesh_config_rejected", "config documents rejected as invalid",
                                 ["service"], registry=metrics)
        self._applied = Counter("llmesh_config_applied", "config documents applied", ["service"], registry=metrics)
        # Worker processes of one service (llmesh.workers) each follow the config: the merged value
        # is the oldest revision any live one runs.
        self._revision = Gauge("llmesh_config_revision", "revision of the config in force", ["service"],
                               registry=metrics, multiprocess_mode="livemin")
        self._task: asyncio.Task[Any] | None = None
        self._checks: list[Check] = []

    def add_check(self, check: Check) -> None:
        """A service's own rule on top of the schema, for every document from now on. The
        config in force is checked at once (services add their checks when their app is
        built, after the first document was applied): one that fails is rejected like any
        invalid document, and the service runs on the defaults, as one that started on an
        invalid document does."""
        self._checks.append(check)
        try:
            check(self.current)
        except InvalidConfig as exc:
            refused, self.current, self.revision = self.revision, MeshConfig(), 0
            self._revision.labels(self._service).set(0)
            self._reject(refused, exc)

    def _reject(self, revision: int, exc: InvalidConfig) -> None:
        self._rejected.labels(self._service).inc()
        log.warning("config rejected; keeping the last good one",
                    extra={"revision": revision, "kept_revision": self.revision, "reason": str(exc)})

    def offer(self, version: Version) -> bool:
        """Validate and apply a document; False (and nothing changed) if it is invalid."""
        if version.revision <= self._seen:
            return False
        self._seen = version.revision
        try:
            config = parse(version.text)
            for check in self._checks:
                check(config)
        except InvalidConfig as exc:
            self._reject(version.revision, exc)
            return False
        self.current, self.revision = config, version.revision
        self._applied.labels(self._service).inc()
        self._revision.labels(self._service).set(version.revision)
        self._save_snapshot(version)
        log.info("config applied", extra={"revision": version.revision})
        return True

    async def start(self) -> None:
        """Load the current document; if the backend is away, the last snapshot; if
        there is none either, ConfigUnavailable naming the address tried."""
        if self._store is None:
            return
        try:
            version = await asyncio.wait_for(self._store.read(), self._start_timeout)
        except Exception as exc:  # any way of being unreachable
            snap = self._load_snapshot()
            if snap is None:
                raise ConfigUnavailable(
                    f"config backend at {self._store.address} is unreachable ({type(exc).__name__}) "
                    f"and there is no snapshot at {self._snapshot}") from exc
            log.warning("config backend unreachable; starting from the snapshot",
                        extra={"backend": self._store.address, "revision": snap.revision})
            version = snap
        if version is not None:
            self.offer(version)
        self._task = asyncio.create_task(self._follow(), name="config-watch")

    async def _follow(self) -> None:
        store = self._store
        assert store is not None  # start() follows only a configured store
        backoff = Backoff(initial_s=0.2, max_s=5.0)
        while True:
            try:
                async for version in store.watch():
                    self.offer(version)
                    backoff.reset()
                wait = backoff.next()  # the watch ended: start over
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - backend away: keep the config, retry
                wait = backoff.next()
                log.warning("config backend unreachable; keeping the current config",
                            extra={"backend": store.address, "error": type(exc).__name__,
                                   "retry_in_s": wait})
            await asyncio.sleep(wait)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _save_snapshot(self, version: Version) -> None:
        if self._snapshot is None:
            return
        try:
            self._snapshot.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._snapshot.with_suffix(f".{os.getpid()}.tmp")  # worker processes may save at once
            tmp.write_text(f"# revision {version.revision}\n{version.text}")
            tmp.replace(self._snapshot)
        except OSError as exc:
            log.warning("cannot write config snapshot", extra={"path": str(self._snapshot), "error": str(exc)})

    def _load_snapshot(self) -> Version | None:
        if self._snapshot is None or not self._snapshot.is_file():
            return None
        text = self._snapshot.read_text()
        first_line, _, body = text.partition("\n")
        revision = int(first_line.removeprefix("# revision ")) if first_line.startswith("# revision ") else 1
        return Version(revision, body)

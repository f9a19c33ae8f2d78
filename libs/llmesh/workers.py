"""Several worker processes of one service on the same ports, under one supervisor.

Each worker binds the service's ports with SO_REUSEPORT (``llmesh.ports.listen_socket(reuse_port=True)``,
and ``GrpcServer(reuse_port=True)``), so the kernel spreads new connections over them and one
service uses every core. The supervisor (:func:`supervise`):

- starts ``count`` workers (``argv`` + ``--worker I --ready-fd FD``) and waits for each to
  write one byte on its pipe once it serves; if one does not, it stops the others and exits 1;
- checks, once they serve, that no other process listens on their ports beside them (SO_REUSEPORT
  would let another of this user's processes, a second mesh's gateway say, take a share of the
  connections silently); if one does, it stops the workers and exits 1 naming it;
- registers the one instance in discovery (the workers register nothing), at the service's
  address: it lives as long as the service, while any single worker may die and come back;
- serves /healthz on the service's metrics port (SERVING from the moment every worker serves
  until the stop; the workers' own gRPC health answers for each one on the shared port);
- serves the workers' metrics merged on the service's metrics port (prometheus_client's
  multiprocess mode in a fresh directory per run, removed on exit, or by the next run if this
  supervisor was killed; the files of a dead worker's live gauges are dropped, its counters
  still count);
- restarts a worker that exits unexpectedly, with backoff, within a budget of restarts per
  window per worker (``RestartPolicy``); past it, it stops everything and exits 1;
- on SIGTERM or SIGINT deregisters, forwards SIGTERM to every worker (each drains its own
  in-flight work within ``grace_s``), waits for them, SIGKILLs what is left after that.
Workers get SIGTERM if the supervisor dies (llmesh.orphans), so none is orphaned."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from llmesh.logs import setup_logging
from llmesh.metrics_http import start_metrics
from llmesh.orphans import die_with_launcher, with_parent
from llmesh.platform import build_registry
from llmesh.ports import foreign_listeners, split_address
from llmesh.restarts import RestartBudget, RestartPolicy
from llmesh.serving import ServingState
from llmesh.service import STOP_MARGIN_S, Registration, StartFailed, check_advertisable, check_health_endpoint
from llmesh.settings import MeshSettings, ServiceSettings

log = logging.getLogger("llmesh.workers")
READY = b"r"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class WorkersFailed(RuntimeError):
    """Workers did not start, or one kept dying past its restart budget."""


def ready_signal(fd: int) -> Callable[[], None]:
    """What a worker calls once it serves: one byte on the pipe its supervisor reads."""
    def ready() -> None:
        os.write(fd, READY)
        os.close(fd)
    return ready


def lower_priority(nice: int) -> None:
    """This process ``nice`` steps nicer than it was, against every other process of the machine.
    Where Linux schedules each session as one group (``/proc/sys/kernel/sched_autogroup_enabled``,
    on by default on many distributions' kernels), a nice value only weighs against the other
    threads of its own session: a niced worker in its parent's session took that session's whole
    share of the cores whenever the parent idled. So the process leads a session of its own and
    gives it its nice value. (In a container's cgroup sessions are not grouped: the nice value
    alone does it.) A process that leads its process group already cannot: it is only niced."""
    level = os.nice(nice)
    try:
        os.setsid()
    except OSError:
        return
    nice_session(level)


def nice_session(level: int) -> bool:
    """Gives this process's session, as one scheduling group, the nice value ``level``; False
    where the kernel does not group sessions (no autogroups, or switched off)."""
    try:
        Path("/proc/self/autogroup").write_text(str(level))
    except OSError:
        return False
    return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"


@dataclass
class _Slot:
    index: int
    budget: RestartBudget
    proc: asyncio.subprocess.Process | None = None
    pids: list[int] = field(default_factory=list)  # every process this slot ran


class Supervisor:
    """Starts, watches, restarts and stops ``count`` worker processes."""

    def __init__(self, argv: Sequence[str], count: int, env: dict[str, str], *, grace_s: float,
                 ready_timeout_s: float = 60.0, policy: RestartPolicy = RestartPolicy(),
                 on_exit: Callable[[int], None] = lambda pid: None, on_restart: Callable[[], None] = lambda: None):
        self._argv = list(argv)
        self._env = env
        self._grace = grace_s
        self._ready_timeout = ready_timeout_s
        self._on_exit = on_exit          # a worker process ended (its pid)
        self._on_restart = on_restart
        self.slots = [_Slot(i, RestartBudget(policy)) for i in range(count)]
        self.failed = asyncio.Event()    # a worker kept dying: the service must stop
        self._watchers: list[asyncio.Task[Any]] = []

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.slots if s.proc is not None and s.proc.returncode is None]

    async def start(self) -> None:
        ready = await asyncio.gather(*(self._spawn(slot) for slot in self.slots), return_exceptions=True)
        if not all(r is True for r in ready):
            await self.stop()
            errors = sorted({f"{type(r).__name__}: {r}" for r in ready if isinstance(r, BaseException)})
            raise WorkersFailed(f"{sum(r is not True for r in ready)} of {len(self.slots)} workers did not start"
                                + (f" ({'; '.join(errors)})" if errors else ""))
        self._watchers = [asyncio.create_task(self._watch(slot), name=f"worker-{slot.index}")
                          for slot in self.slots]

    async def _spawn(self, slot: _Slot) -> bool:
        """Start the slot's worker; True once it says it serves, False if it died or took
        longer than the ready timeout (then it is killed)."""
        r, w = os.pipe()
        try:
            slot.proc = await asyncio.create_subprocess_exec(
                *self._argv, "--worker", str(slot.index), "--ready-fd", str(w), env=with_parent(self._env),
                pass_fds=(w,), stdin=asyncio.subprocess.DEVNULL)
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        proc = slot.proc
        slot.pids.append(proc.pid)
        log.info("worker started", extra={"worker": slot.index, "pid": proc.pid})
        reader = asyncio.ensure_future(asyncio.to_thread(os.read, r, 1))
        reader.add_done_callback(lambda _: os.close(r))  # the read ends when the worker writes or exits
        done, _ = await asyncio.wait({reader}, timeout=self._ready_timeout)
        if not done:
            log.error("worker not ready in time; killing it", extra={
                "worker": slot.index, "pid": proc.pid, "timeout_s": self._ready_timeout})
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        ok = await reader == READY
        if ok:
            log.info("worker ready", extra={"worker": slot.index, "pid": proc.pid})
        return ok

    async def _watch(self, slot: _Slot) -> None:
        while True:
            proc = slot.proc
            assert proc is not None  # spawned before it is watched
            code = await proc.wait()
            self._on_exit(proc.pid)
            delay = slot.budget.next_delay(time.monotonic())
            extra = {"worker": slot.index, "pid": proc.pid, "exit_code": code}
            if delay is None:
                log.error("worker keeps exiting; restart budget spent, stopping the service", extra=extra)
                self.failed.set()
                return
            log.warning("worker exited; restarting it", extra={**extra, "restart_in_s": delay})
            await asyncio.sleep(delay)
            self._on_restart()
            await self._spawn(slot)  # not ready: its exit comes round this loop and spends budget

    async def stop(self) -> list[int | None]:
        """SIGTERM every worker, wait ``grace_s`` + STOP_MARGIN_S, SIGKILL the rest; their exit codes."""
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        live = [s.proc for s in self.slots if s.proc is not None and s.proc.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        if live:
            waits = [asyncio.ensure_future(p.wait()) for p in live]
            _, late = await asyncio.wait(waits, timeout=self._grace + STOP_MARGIN_S)
            if late:
                log.warning("workers still running after the grace period; killing them",
                            extra={"pids": [p.pid for p in live if p.returncode is None]})
            for proc in live:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
        for proc in live:
            self._on_exit(proc.pid)
        codes = [s.proc.returncode if s.proc is not None else None for s in self.slots]
        log.info("workers stopped", extra={"exit_codes": codes})
        return codes


def fresh_metrics_dir(name: str, parent: str | None = None) -> str:
    """A new, empty directory for this run's metrics files, named after this process;
    those a supervisor killed before it could remove them (its pid gone) are removed."""
    root = Path(parent or tempfile.gettempdir())
    prefix = f"llmesh-{name}-metrics-"
    for old in root.glob(prefix + "*"):
        pid = old.name.removeprefix(prefix).partition("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)


async def _check_alone(supervisor: Supervisor, addresses: Sequence[str]) -> None:
    """Stops the workers and raises WorkersFailed if another process listens on their ports."""
    for address in addresses:
        strangers = await asyncio.to_thread(foreign_listeners, *split_address(address), supervisor.pids())
        if strangers:
            await supervisor.stop()
            raise WorkersFailed(f"{address} is shared with {', '.join(strangers)}: it listens there with "
                                "SO_REUSEPORT too, and would take a share of the connections; stop it or "
                                "give this service other ports")


async def _supervise(name: str, settings: ServiceSettings, argv: Sequence[str], count: int,
                     health_service: str, policy: RestartPolicy, shared: Sequence[str]) -> int:
    mesh = MeshSettings()
    check_advertisable(name, settings, mesh)
    check_health_endpoint(name, settings, mesh)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    env = {k: v for k, v in os.environ.items() if k != MULTIPROC_ENV}
    metrics_dir, metrics_server, restarts = None, None, None
    serving = ServingState()  # the service's /healthz: SERVING from all workers ready until the stop
    try:
        if settings.metrics_port is not None:
            metrics_dir = fresh_metrics_dir(name)
            env[MULTIPROC_ENV] = metrics_dir
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=metrics_dir)
            restarts = Counter("llmesh_worker_restarts", "Worker processes restarted after an unexpected exit.",
                               registry=registry)
            metrics_server = await start_metrics(registry, settings.host, settings.metrics_port,
                                                 settings.bind_wait_s, serving)
        supervisor = Supervisor(
            argv, count, env, grace_s=settings.grace_s, policy=policy,
            on_exit=(lambda pid: mark_process_dead(pid, metrics_dir)) if metrics_dir else (lambda pid: None),
            on_restart=restarts.inc if restarts is not None else (lambda: None))
        await supervisor.start()
        await _check_alone(supervisor, shared or [settings.address])
        registry_backend = build_registry(mesh)
        serving.set(True)
        registration = Registration(name, registry_backend, mesh, settings.advertise_address or settings.address,
                                    health_service, metrics_server.server_port if metrics_server else None)
        log.info("workers serving", extra={"workers": count, "pids": supervisor.pids(),
                                           "address": settings.address, "metrics_dir": metrics_dir})
        waits = [asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(supervisor.failed.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        log.info("stopping", extra={"grace_s": settings.grace_s})
        serving.set(False)
        await registration.end()
        with contextlib.suppress(Exception):
            await registry_backend.close()
        await supervisor.stop()
        log.info("stopped")
        return 1 if supervisor.failed.is_set() else 0
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def supervise(name: str, settings: ServiceSettings, argv: Sequence[str], count: int, health_service: str,
              policy: RestartPolicy = RestartPolicy(), shared: Sequence[str] = ()) -> None:
    """Run ``count`` workers of ``name`` (each started as ``argv``) until SIGTERM or SIGINT;
    ``shared``: the host:port addresses the workers share (default: the service's address)."""
    die_with_launcher()
    setup_logging(name, settings.log_level, {"role": "supervisor"})
    main = _supervise(name, settings, argv, count, health_service, policy, shared)
    try:
        code = uvloop.run(main) if settings.event_loop == "uvloop" else asyncio.run(main)
    except (OSError, StartFailed, WorkersFailed) as exc:
        log.error("cannot start", extra={"error": str(exc)})
        raise SystemExit(1) from exc
    if code:
        raise SystemExit(code)

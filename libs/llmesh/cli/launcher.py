"""The local actuator of autoscaling: starts and stops engine processes on this
machine so that each scaled model has the replicas the scheduler wants.

``llmesh up --autoscale MODEL=BACKEND`` runs ``follow``: it polls the scheduler's
GetScale, and the launcher starts engines (into the supervised list of children, so
one that dies is restarted like any other) or drains them. Stopping a replica is the
engine's own drain: SIGTERM makes it tell the scheduler it is draining (gateways stop
picking it), keep accepting for ROUTE_AWAY_S (requests already routed to it still
land), finish what it runs within its grace period, and exit. New replicas
take engine indexes after the fixed ``--engines`` ones, reusing freed ones."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import grpc

from llmesh.cli.layout import MAX_ENGINES
from llmesh.cli.up import Child, MeshSpec, engine_child
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import Identity
from llmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("llmesh.launcher")
# A drained engine keeps accepting this long after it told the scheduler, so a request a
# gateway routed to it just before it heard still lands (engine setting route_away_s).
ROUTE_AWAY_S = 0.5


class EngineLauncher:
    def __init__(self, spec: MeshSpec, children: list[Child], backends: dict[str, str],
                 say: Callable[[str], None] = print):
        self._spec = spec
        self._children = children            # the supervised list: we add to it and take from it
        self.backends = backends             # scaled model -> engine backend
        self._say = say
        self._replicas: dict[str, list[Child]] = {m: [] for m in backends}
        self._draining: dict[str, asyncio.Task[Any]] = {}  # child name -> its stop

    def replicas(self, model: str) -> list[Child]:
        return list(self._replicas[model])

    def _free_index(self) -> int:
        used = {c.name for c in self._children} | set(self._draining)
        for i in range(len(self._spec.engines), MAX_ENGINES):
            if f"engine-{i}" not in used:
                return i
        raise RuntimeError(f"no free engine index below {MAX_ENGINES}")

    def reconcile(self, desired: dict[str, int], busy: dict[str, int] | None = None) -> bool:
        """Start or drain replicas of each scaled model named in ``desired``; True if anything
        changed. ``busy``: requests running or waiting per engine name; the least busy drains first."""
        busy = busy or {}
        changed = False
        for model, want in desired.items():
            if model not in self._replicas:
                continue
            have = self._replicas[model]
            while len(have) < want:
                child = engine_child(self._spec, self._free_index(), self.backends[model], model)
                child.env["LLMESH_ENGINE_ROUTE_AWAY_S"] = str(ROUTE_AWAY_S)
                child.start()
                have.append(child)
                self._children.append(child)
                self._say(f"llmesh: autoscaler started {child.name} for {model} (pid {child.process.pid}; "
                          f"{len(have)} of {want})")
                changed = True
            while len(have) > want:
                # the least busy; among equals the newest
                child = min(reversed(have), key=lambda c: busy.get(c.name, 0))
                have.remove(child)
                self._children.remove(child)  # out of supervision first: its exit is no crash
                self._draining[child.name] = asyncio.create_task(self._drain(child, model, want))
                changed = True
        return changed

    async def _drain(self, child: Child, model: str, want: int) -> None:
        self._say(f"llmesh: autoscaler drains {child.name} of {model} (down to {want})")
        try:
            if child.alive():
                child.process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.to_thread(child.process.wait, self._spec.grace_s + 2 + ROUTE_AWAY_S)
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    await asyncio.to_thread(child.process.wait)
            self._say(f"llmesh: {child.name} stopped (exit code {child.process.returncode})")
        finally:
            self._draining.pop(child.name, None)

    async def close(self) -> None:
        """Let the drains under way finish (the rest of the mesh is stopped by the supervisor)."""
        await asyncio.gather(*self._draining.values(), return_exceptions=True)


async def follow(launcher: EngineLauncher, scheduler_address: str, stop: asyncio.Event, interval_s: float = 0.5,
                 on_change: Callable[[], None] = lambda: None, identity: Identity | None = None) -> None:
    """Polls the scheduler's desired replicas and makes the launcher match them until ``stop``
    (as ``identity``, the cli's, where the mesh requires one). While the scheduler is
    unreachable nothing changes."""
    async with mesh_channel(scheduler_address, "scheduler", identity) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while not stop.is_set():
            try:
                state = await stub.GetScale(scheduler_pb2.GetScaleRequest(), timeout=2)
                table = await stub.ListEndpoints(scheduler_pb2.ListEndpointsRequest(), timeout=2)
            except grpc.aio.AioRpcError as exc:
                log.warning("cannot read desired replicas", extra={"error": exc.code().name})
            else:
                busy = {e.endpoint_id: e.load.running + e.load.waiting for e in table.endpoints}
                if launcher.reconcile({m.model: m.desired for m in state.models}, busy):
                    on_change()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)

"""The endpoint table: engines and their last reported load. Pure logic; the clock is
passed in so tests can drive it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from llmesh.types import Hardware, SelfTest
from llmesh.scheduler.health import HealthJudge, NodeSignals

log = logging.getLogger("llmesh.scheduler")


@dataclass(frozen=True, slots=True)
class Load:
    running: int = 0
    waiting: int = 0
    max_running: int = 1
    max_waiting: int = 0


@dataclass(frozen=True, slots=True)
class Served:
    """A model or LoRA adapter an engine serves (see scheduler.proto ServedModel)."""
    name: str
    context_length: int = 0
    base_model: str = ""
    in_flight: int = 0
    embeddings: bool = False  # an embedding model (Embed, not Generate)
    tools: bool = False  # its backend calls tools


@dataclass(frozen=True, slots=True)
class EndpointState:
    endpoint_id: str
    address: str
    backend: str
    models: tuple[str, ...]
    load: Load = field(default_factory=Load)
    draining: bool = False
    last_report: float = 0.0
    healthy: bool = True
    self_test_ok: bool = True
    signals: NodeSignals = field(default_factory=NodeSignals)  # not part of change detection
    degraded: str = ""  # why the node gets no new work (see health.py); "" when fine
    hardware: Hardware | None = None    # as last reported; not part of change detection
    self_test: SelfTest | None = None   # as last reported; not part of change detection
    served: tuple[Served, ...] = ()
    replica_gpus: int = 0  # GPUs one replica spans on this engine; 0: not fixed by the engine


class EndpointTable:
    """Endpoints keyed by id. Every change bumps ``version`` and wakes watchers."""

    def __init__(self, stale_after_s: float = 3.0,
                 on_change: Callable[[list[EndpointState]], None] = lambda endpoints: None,
                 judge: HealthJudge | None = None):
        self._on_change = on_change
        self._judge = judge or HealthJudge()
        self._endpoints: dict[str, EndpointState] = {}
        self._stale_after = stale_after_s
        self.version = 0
        self._changed = asyncio.Condition()

    def snapshot(self) -> list[EndpointState]:
        return list(self._endpoints.values())

    async def upsert(self, state: EndpointState, changed: bool = False) -> None:
        """``changed``: news beyond the state itself (KV blocks): wake watchers anyway."""
        old = self._endpoints.get(state.endpoint_id)
        peers = [e.signals.latency_ms for e in self._endpoints.values()
                 if e.endpoint_id != state.endpoint_id and e.backend == state.backend]
        degraded = self._judge.judge(state.endpoint_id, state.signals, state.last_report, peers)
        state = replace(state, healthy=not state.draining and state.self_test_ok, degraded=degraded)
        if degraded != (old.degraded if old is not None else ""):
            if degraded:
                log.warning("endpoint degraded: no new work", extra={"endpoint_id": state.endpoint_id,
                                                                      "reason": degraded})
            else:
                log.info("endpoint recovered", extra={"endpoint_id": state.endpoint_id})
        self._endpoints[state.endpoint_id] = state
        if changed or old is None or _news(old) != _news(state):
            await self._bump()

    async def remove(self, endpoint_id: str) -> None:
        self._judge.forget(endpoint_id)
        if self._endpoints.pop(endpoint_id, None) is not None:
            await self._bump()

    async def expire(self, now: float) -> None:
        """Marks endpoints that stopped reporting as unhealthy."""
        changed = False
        for eid, st in list(self._endpoints.items()):
            stale = now - st.last_report > self._stale_after
            if stale and st.healthy:
                self._endpoints[eid] = replace(st, healthy=False)
                changed = True
        if changed:
            await self._bump()

    async def wait_for_change(self, seen_version: int) -> int:
        async with self._changed:
            await self._changed.wait_for(lambda: self.version != seen_version)
            return self.version

    async def _bump(self) -> None:
        self._on_change(self.snapshot())
        async with self._changed:
            self.version += 1
            self._changed.notify_all()


def _news(s: EndpointState) -> EndpointState:
    """What watchers need to hear about: not the report's time nor raw signals."""
    return replace(s, last_report=0.0, hardware=None, self_test=None, signals=NodeSignals())

"""Queue-driven autoscaling: how many replicas each model should have.

Pure logic fed plain inputs (the model's load, its policy from the live config, the
time); actuators (the local launcher of ``llmesh up``, KEDA through the scheduler's
metrics) make the fleet match. The rules, per model:

- up: more than ``waiting_per_replica`` waiting per desired replica asks for
  ceil(waiting / waiting_per_replica) replicas (at least one more). A model at zero
  with one request waiting (held at a gateway) gets a replica at once.
- waiting time: a request held longer than ``max_wait_s`` adds one replica, at most
  one per ``max_wait_s`` (a replica that does not come up gets company).
- down: never within ``cooldown_s`` of the last change. Nothing running or waiting
  for ``idle_s``: down to ``min_replicas`` (zero by default). Busy, with replicas
  to spare (all started): down to the most that any moment of the last
  ``cooldown_s`` needed (busy replicas, or the queue's ceil(waiting /
  waiting_per_replica)), at least one.
- always within [min_replicas, max_replicas]."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from collections import deque
from dataclasses import dataclass, field

from llmesh.liveconfig.schema import Autoscale, Autoscaling
from llmesh.scheduler.table import EndpointState


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model's fleet as the scheduler sees it now."""
    ready: int = 0              # healthy replicas serving it
    busy: int = 0               # of those, replicas running or queueing something
    running: int = 0
    waiting: int = 0            # engine queues plus requests held at gateways
    oldest_wait_s: float = 0.0  # the longest a held request has waited so far


@dataclass(frozen=True, slots=True)
class Decision:
    model: str
    desired: int
    load: ModelLoad
    reason: str                 # why desired is what it is: up | waiting_time | idle | spare | bounds | steady
    previous: int = 0           # desired before this decision

    @property
    def changed(self) -> bool:
        return self.desired != self.previous


class _Window:
    """The replicas each recent decision needed, kept for a stabilization window: a
    scale-down goes no lower than the most any moment in it needed (as Kubernetes' HPA
    does), so a lull between two bursts removes nothing."""

    def __init__(self) -> None:
        self._needs: deque[tuple[float, int]] = deque()

    def append(self, need: int, now: float, window_s: float) -> None:
        self._needs.append((now, need))
        while self._needs[0][0] < now - window_s:
            self._needs.popleft()

    def __iter__(self) -> Iterator[int]:
        return (n for _, n in self._needs)


@dataclass(slots=True)
class _State:
    desired: int
    changed_at: float
    busy_at: float
    bumped_at: float = -math.inf  # the last waiting-time step
    needs: _Window = field(default_factory=_Window)


class Autoscaler:
    """Keeps each scaled model's desired replica count across decisions."""

    def __init__(self) -> None:
        self._state: dict[str, _State] = {}

    def decide(self, model: str, policy: Autoscale, load: ModelLoad, now: float) -> Decision:
        st = self._state.get(model)
        if st is None:  # first sight: what runs now, within bounds
            st = self._state[model] = _State(_clamp(load.ready, policy), now, now)
        if load.running or load.waiting:
            st.busy_at = now
        st.needs.append(max(1, load.busy, math.ceil(load.waiting / policy.waiting_per_replica)), now,
                        policy.cooldown_s)
        desired, reason = _clamp(st.desired, policy), "steady"
        if desired != st.desired:
            reason = "bounds"
        if load.waiting > policy.waiting_per_replica * desired:
            desired = max(desired + 1, math.ceil(load.waiting / policy.waiting_per_replica))
            reason = "up"
        elif load.oldest_wait_s > policy.max_wait_s and now - st.bumped_at >= policy.max_wait_s:
            desired, reason = desired + 1, "waiting_time"
            st.bumped_at = now
        elif now - st.changed_at >= policy.cooldown_s:
            if not (load.running or load.waiting):
                if now - st.busy_at >= policy.idle_s:
                    desired, reason = policy.min_replicas, "idle"
            elif load.ready >= desired:  # not while replicas are still starting
                needed = max(st.needs)    # the most any moment of the last cooldown_s needed
                if needed < desired:
                    desired, reason = needed, "spare"
        desired, previous = _clamp(desired, policy), st.desired
        if desired != previous:
            st.desired, st.changed_at = desired, now
        return Decision(model, desired, load, reason, previous)

    def forget(self, keep: set[str]) -> None:
        """Models no longer scaled (gone from the config) lose their state."""
        for model in set(self._state) - keep:
            del self._state[model]


def model_loads(endpoints: list[EndpointState], held: dict[str, tuple[int, float]],
                models: set[str]) -> dict[str, ModelLoad]:
    """Each of ``models``' load from the endpoint table and the gateways' held requests."""
    out = {}
    for model in models:
        serving = [e for e in endpoints if model in e.models and e.healthy and not e.degraded]
        n_held, oldest = held.get(model, (0, 0.0))
        out[model] = ModelLoad(ready=len(serving), busy=sum(1 for e in serving if e.load.running or e.load.waiting),
                               running=sum(e.load.running for e in serving),
                               waiting=sum(e.load.waiting for e in serving) + n_held, oldest_wait_s=oldest)
    return out


def _clamp(n: int, policy: Autoscale) -> int:
    return min(max(n, policy.min_replicas), policy.max_replicas)


@dataclass(frozen=True, slots=True)
class Held:
    """Requests one gateway holds for a model with no ready replica."""
    count: int
    oldest_wait_s: float
    at: float  # when the gateway said so


class DemandBook:
    """What each gateway last reported holding, per model. A report replaces the
    gateway's previous one; one older than ``ttl_s`` no longer counts (a gateway
    that went away holds nothing)."""

    def __init__(self, ttl_s: float = 3.0) -> None:
        self._ttl = ttl_s
        self._by_gateway: dict[str, dict[str, Held]] = {}

    def report(self, gateway: str, held: dict[str, tuple[int, float]], now: float) -> None:
        self._by_gateway[gateway] = {m: Held(n, w, now) for m, (n, w) in held.items() if n > 0}

    def held(self, now: float) -> dict[str, tuple[int, float]]:
        """Per model: requests held across gateways and the longest wait among them."""
        out: dict[str, tuple[int, float]] = {}
        for gateway, models in list(self._by_gateway.items()):
            fresh = {m: h for m, h in models.items() if now - h.at <= self._ttl}
            if not fresh:
                del self._by_gateway[gateway]
                continue
            for m, h in fresh.items():
                n, w = out.get(m, (0, 0.0))
                out[m] = (n + h.count, max(w, h.oldest_wait_s + (now - h.at)))
        return out


class FleetScaler:
    """Decides for every scaled model from the endpoint table, the gateways' held
    requests and the live config; ``decisions`` holds the latest."""

    def __init__(self, endpoints: Callable[[], list[EndpointState]], config: Callable[[], Autoscaling],
                 on_decide: Callable[[list[Decision]], None] = lambda decisions: None, demand_ttl_s: float = 3.0):
        self._endpoints = endpoints
        self._config = config
        self._on_decide = on_decide
        self.demand = DemandBook(demand_ttl_s)
        self.autoscaler = Autoscaler()
        self.decisions: dict[str, Decision] = {}

    def tick(self, now: float) -> list[Decision]:
        policies = self._config().models
        loads = model_loads(self._endpoints(), self.demand.held(now), set(policies))
        self.autoscaler.forget(set(policies))
        decisions = [self.autoscaler.decide(m, policies[m], loads[m], now) for m in sorted(policies)]
        self.decisions = {d.model: d for d in decisions}
        self._on_decide(decisions)
        return decisions

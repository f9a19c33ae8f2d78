"""Where a model's replicas go: a bin-packing planner over the engines' nodes. Pure.

Each engine serves one model at a time, so a replica takes one engine (and the node
it runs on). A replica needs ``memory_bytes``: in CPU memory when ``gpus`` is 0, else
split evenly over ``gpus`` GPUs of that one node (tensor parallelism), and then it is
placed on all of them or not at all (gang): a node with too few GPUs that have room
for their share gets no part of it, nor does an engine started to run a replica over
another number of GPUs (``Node.replica_gpus``: vLLM's tensor parallel size). The
request as a whole is all or nothing too: either every replica has a place, or the
plan is refused saying why, node by node.

Engines already serving the model keep their replica. Among the others, idle engines
come before engines serving another model (a load would replace it), then the best
fit (least memory left over on the node, so big nodes stay free for big replicas), then
the least loaded."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from llmesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from llmesh.scheduler.table import EndpointState

GIB = 2**30


@dataclass(frozen=True, slots=True)
class Node:
    """An engine and what its node has free, as it last reported."""
    endpoint_id: str
    address: str
    backend: str
    models: tuple[str, ...] = ()
    gpu_free_bytes: tuple[int, ...] = ()   # per GPU, by its index in the engine's hardware profile
    memory_free_bytes: int = 0             # available RAM
    load: int = 0                          # requests running + waiting
    replica_gpus: int = 0                  # GPUs a replica spans there, as the engine was started; 0: not fixed


def node_of(e: EndpointState) -> Node | None:
    """An engine that may take new work, as a placement node; None otherwise."""
    if not e.healthy or e.degraded or e.hardware is None:
        return None
    hw = e.hardware
    return Node(e.endpoint_id, e.address, e.backend, e.models,
                tuple(max(g.memory_total_bytes - g.memory_used_bytes, 0) for g in hw.gpus),
                hw.memory_available_bytes, e.load.running + e.load.waiting, e.replica_gpus)


@dataclass(frozen=True, slots=True)
class Ask:
    model: str                             # the served name
    replicas: int
    memory_bytes: int                      # one replica's need, headroom included
    gpus: int = 0                          # 0: CPU memory; k: k GPUs of one node
    backends: frozenset[str] = frozenset()  # empty: any
    avoid_models: frozenset[str] = frozenset()  # engines serving one of these are left alone


@dataclass(frozen=True, slots=True)
class Slot:
    node: Node
    already_serving: bool = False


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def fit(node: Node, ask: Ask) -> int | str:
    """The node's memory left over once a new replica of ``ask`` is there, or why it does
    not fit. On GPUs it fits when ``ask.gpus`` of them hold a share each; which ones is the
    engine's business (it runs a model on the devices it was started with). Left over
    counts all the node's GPUs, so nodes with many free GPUs stay whole for the replicas
    that need many."""
    if not ask.gpus:
        left = node.memory_free_bytes - ask.memory_bytes
        return left if left >= 0 else f"{_gib(node.memory_free_bytes)} memory free, {_gib(ask.memory_bytes)} needed"
    share = math.ceil(ask.memory_bytes / ask.gpus)
    roomy = sum(free >= share for free in node.gpu_free_bytes)
    if roomy < ask.gpus:
        return f"{roomy} of its {len(node.gpu_free_bytes)} GPU(s) have {_gib(share)} free; {ask.gpus} needed"
    return sum(node.gpu_free_bytes) - ask.memory_bytes


def plan(nodes: Iterable[Node], ask: Ask) -> list[Slot]:
    """One slot per replica, or a refusal: InvalidArgument for a malformed ask,
    FailedPrecondition when the fleet cannot hold it however free it were (too few
    eligible engines, no node with enough GPUs), ResourceExhausted when memory is
    short now."""
    if not ask.model:
        raise InvalidArgument("model is required", param="model")
    if ask.replicas < 1:
        raise InvalidArgument("replicas must be at least 1", param="replicas")
    if ask.memory_bytes <= 0:
        raise InvalidArgument("memory_bytes must be more than 0", param="memory_bytes")
    if ask.gpus < 0:
        raise InvalidArgument("gpus_per_replica must not be negative", param="gpus_per_replica")
    what = f"{ask.replicas} replica(s) of {ask.model}"
    eligible = [n for n in nodes if (not ask.backends or n.backend in ask.backends)
                and (ask.model in n.models or not set(n.models) & ask.avoid_models)]
    # an engine runs a replica over the GPUs it was started with: one started for another count is no place
    other_tp = [n for n in eligible if n.replica_gpus and n.replica_gpus != ask.gpus and ask.model not in n.models]
    eligible = [n for n in eligible if n not in other_tp]
    left_out = (f"; left out, as they run a replica over another number of GPUs than {ask.gpus}: "
                + ", ".join(sorted(n.endpoint_id for n in other_tp))) if other_tp else ""
    if ask.gpus:
        most = max((len(n.gpu_free_bytes) for n in eligible), default=0)
        if most < ask.gpus:
            raise FailedPrecondition(f"{what} need {ask.gpus} GPUs each on one node; the most any eligible "
                                     f"engine's node has is {most} (a replica is never split across nodes)"
                                     f"{left_out}", reason="gang_unplaceable")
    if len(eligible) < ask.replicas:
        raise FailedPrecondition(f"{what} need {ask.replicas} healthy engine(s) of "
                                 f"{'/'.join(sorted(ask.backends)) or 'any backend'} not serving traffic for "
                                 f"another alias; {len(eligible)} found{left_out}", reason="too_few_engines")
    serving = sorted((n for n in eligible if ask.model in n.models), key=lambda n: (n.load, n.endpoint_id))
    slots = [Slot(n, already_serving=True) for n in serving[:ask.replicas]]
    fitting, refused = [], []
    for n in eligible:
        if ask.model in n.models:
            continue
        got = fit(n, ask)
        if isinstance(got, str):
            refused.append(f"{n.endpoint_id}: {got}")
        else:
            fitting.append((bool(n.models), got, n.load, n.endpoint_id, n))
    fitting.sort(key=lambda f: f[:4])
    missing = ask.replicas - len(slots)
    if len(fitting) < missing:
        need = f"{_gib(math.ceil(ask.memory_bytes / ask.gpus))} on each of {ask.gpus} GPU(s) of one node" \
            if ask.gpus else f"{_gib(ask.memory_bytes)} of memory"
        raise ResourceExhausted(f"{what} need {need}; {len(slots) + len(fitting)} of {ask.replicas} place(s) "
                                f"found ({'; '.join(refused)}); nothing was placed{left_out}",
                                reason="insufficient_memory")
    return slots + [Slot(f[4]) for f in fitting[:missing]]

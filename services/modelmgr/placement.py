"""Where a version's replicas go and which variant they run: pure functions over
the scheduler's endpoint list (each engine's backend, models, load and hardware).

Variant choice (seed 003): the best variant whose memory need fits 85 % of the
target's free memory; "best" is the one with the most bits per weight, i.e. the
largest file. The need is the weights plus a margin for the KV cache and buffers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmesh.errors import FailedPrecondition, Unavailable
from llmesh.modelmgr.registry import Artifact

BACKENDS_FOR_FORMAT = {"gguf": ("llamacpp",)}  # safetensors (vllm) loads from the engine's own path today


@dataclass(frozen=True, slots=True)
class Engine:
    endpoint_id: str
    address: str
    backend: str
    models: tuple[str, ...]
    healthy: bool
    load: int                 # running + waiting
    free_memory_bytes: int    # GPU memory free if it has GPUs, else available RAM


def memory_need(artifact: Artifact, overhead: float) -> int:
    return int(artifact.size_bytes * (1.0 + overhead))


def choose_variant(artifacts: Iterable[Artifact], free_memory_bytes: int, budget_fraction: float = 0.85,
                   overhead: float = 0.25) -> Artifact:
    budget = free_memory_bytes * budget_fraction
    fitting = [a for a in artifacts if memory_need(a, overhead) <= budget]
    if not fitting:
        sizes = ", ".join(f"{a.variant} {memory_need(a, overhead) / 2**20:.0f} MiB" for a in artifacts)
        raise FailedPrecondition(f"no variant fits {budget_fraction:.0%} of {free_memory_bytes / 2**20:.0f} MiB "
                                 f"free ({sizes})")
    return max(fitting, key=lambda a: (a.size_bytes, a.variant))


def place(engines: Iterable[Engine], fmt: str, replicas: int, served: str, busy: set[str]) -> list[Engine]:
    """``replicas`` engines for a version served as ``served``: healthy engines of a
    backend that loads ``fmt``, not serving a model an alias routes to (``busy``:
    loading there would take it from its traffic), those already serving it first,
    then idle ones (no model), then the least loaded."""
    backends = BACKENDS_FOR_FORMAT.get(fmt, ())
    candidates = [e for e in engines if e.healthy and e.backend in backends
                  and (served in e.models or not (set(e.models) & busy))]
    if len(candidates) < replicas:
        raise Unavailable(f"{replicas} replica(s) of {served} need {replicas} healthy {'/'.join(backends) or fmt} "
                          f"engine(s) not serving traffic for an alias; {len(candidates)} found")
    candidates.sort(key=lambda e: (served not in e.models, bool(e.models), e.load, e.endpoint_id))
    return candidates[:replicas]

"""Which variant a version's replicas run and where: the scheduler plans the places
(it bin-packs replicas onto engines by memory need, see its Place RPC); here, the
variant. Seed 003: the best variant whose memory need fits a share (the budget) of
the target's free memory; "best" is the one with the most bits per weight, i.e. the
largest file. The need is the weights plus a margin for the KV cache and buffers, so
the largest variant the scheduler can place wins."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from llmesh.errors import ErrorCode, LlmeshError, ResourceExhausted
from llmesh.modelmgr.registry import Artifact

# The engine backends that load each artifact format: a GGUF file on llama.cpp, a
# Hugging Face safetensors directory on vLLM.
BACKENDS_FOR_FORMAT = {"gguf": ("llamacpp",), "safetensors": ("vllm",)}


def gpus_per_replica(fmt: str, vllm_gpus: int) -> int:
    """GPUs one replica of ``fmt`` takes: llama.cpp here runs in CPU memory (no layers
    offloaded); vLLM takes ``vllm_gpus`` (its tensor parallel size; 0 for its CPU build)."""
    return vllm_gpus if fmt == "safetensors" else 0


@dataclass(frozen=True, slots=True)
class Engine:
    endpoint_id: str
    address: str
    backend: str
    models: tuple[str, ...]
    healthy: bool
    load: int                 # running + waiting


@dataclass(frozen=True, slots=True)
class Target:
    """Where the scheduler placed one replica."""
    endpoint_id: str
    address: str
    already_serving: bool = False


def memory_need(artifact: Artifact, overhead: float) -> int:
    return int(artifact.size_bytes * (1.0 + overhead))


def memory_to_ask(artifact: Artifact, budget_fraction: float, overhead: float) -> int:
    """What a replica of ``artifact`` asks the scheduler for: its need, over the budget
    fraction (so the need fits that share of the free memory)."""
    return math.ceil(memory_need(artifact, overhead) / budget_fraction)


async def place_variant(artifacts: Iterable[Artifact], place: Callable[[int], Awaitable[list[Target]]],
                        budget_fraction: float = 0.85, overhead: float = 0.25) -> tuple[Artifact, list[Target]]:
    """The largest variant the scheduler can place (``place(memory_bytes)``), and its
    places. A refusal for memory tries the next smaller variant; any other refusal
    (too few engines, say) ends the search: a smaller variant would not change it."""
    tried = []
    for a in sorted(artifacts, key=lambda a: (a.size_bytes, a.variant), reverse=True):
        try:
            return a, await place(memory_to_ask(a, budget_fraction, overhead))
        except LlmeshError as exc:
            if exc.code is not ErrorCode.RESOURCE_EXHAUSTED:
                raise
            tried.append(f"{a.variant} ({memory_need(a, overhead) / 2**20:.0f} MiB): {exc.message}")
    raise ResourceExhausted(f"no variant fits {budget_fraction:.0%} of any engine's free memory: "
                            + " | ".join(tried), reason="insufficient_memory")

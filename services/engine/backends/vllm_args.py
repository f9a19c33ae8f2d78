"""The vllm backend's engine options for the GPU path, mapped to vLLM's AsyncEngineArgs
without importing vLLM (so the mapping is tested where vLLM is absent).

Tensor parallel size, quantization, dtype, max_num_seqs and the runner are settings of their own
(LLMESH_ENGINE_VLLM_*), as are the model, its window, the GPU memory share, LoRA and the KV
events; any other AsyncEngineArgs field goes in ``extra`` by its field name. ``check``
refuses, before vLLM loads anything, an extra name that AsyncEngineArgs does not have (a
typo: the error names it and the nearest field) or one an own setting sets."""

from __future__ import annotations

import difflib
import os
import tempfile
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# AsyncEngineArgs fields the engine sets from its own settings: what to set instead.
OWN_ARGS: dict[str, str] = {
    "model": "LLMESH_ENGINE_VLLM_MODEL_PATH",
    "served_model_name": "LLMESH_ENGINE_MODEL",
    "max_model_len": "LLMESH_ENGINE_VLLM_MAX_MODEL_LEN",
    "gpu_memory_utilization": "LLMESH_ENGINE_VLLM_GPU_MEMORY_UTILIZATION",
    "tensor_parallel_size": "LLMESH_ENGINE_VLLM_TENSOR_PARALLEL_SIZE",
    "quantization": "LLMESH_ENGINE_VLLM_QUANTIZATION",
    "dtype": "LLMESH_ENGINE_VLLM_DTYPE",
    "max_num_seqs": "LLMESH_ENGINE_VLLM_MAX_NUM_SEQS",
    "enable_lora": "LLMESH_ENGINE_VLLM_ENABLE_LORA",
    "max_loras": "LLMESH_ENGINE_VLLM_MAX_LORAS",
    "max_lora_rank": "LLMESH_ENGINE_VLLM_MAX_LORA_RANK",
    "enable_prefix_caching": "nothing (always on: the prefix-cache stats and KV events need it)",
    "kv_events_config": "LLMESH_ENGINE_VLLM_KV_EVENTS and LLMESH_ENGINE_VLLM_KV_EVENTS_ENDPOINT",
    "runner": "LLMESH_ENGINE_VLLM_RUNNER",
}
EXTRA_SETTING = "LLMESH_ENGINE_VLLM_ENGINE_ARGS"


@dataclass(frozen=True)
class VllmEngineOptions:
    """The GPU path's AsyncEngineArgs beyond the model, its window, memory share and LoRA."""

    tensor_parallel_size: int = 1
    quantization: str | None = None  # None: as the model's config says
    dtype: str = "auto"
    max_num_seqs: int | None = None  # None: vLLM's default for the device
    runner: Literal["generate", "pooling"] = "generate"  # vLLM's runner: generate (Generate) or pooling (Embed)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def args(self) -> dict[str, Any]:
        """AsyncEngineArgs keyword arguments (``check`` them first)."""
        return {"tensor_parallel_size": self.tensor_parallel_size, "quantization": self.quantization,
                "dtype": self.dtype, "max_num_seqs": self.max_num_seqs, "runner": self.runner, **self.extra}

    def check(self, fields: Collection[str]) -> None:
        """Refuses extra names that are not ``fields`` (AsyncEngineArgs') or that own settings set."""
        problems = [problem for name in sorted(self.extra) if (problem := extra_arg_problem(name, fields))]
        if problems:
            raise ValueError(f"{EXTRA_SETTING}: " + "; ".join(problems))


def extra_arg_problem(name: str, fields: Collection[str]) -> str | None:
    """Why ``name`` cannot be an extra engine argument (None: it can)."""
    if name in OWN_ARGS:
        return f"{name!r} is set by {OWN_ARGS[name]}, not here"
    if name not in fields or name.startswith("_"):
        near = difflib.get_close_matches(name, [f for f in fields if not f.startswith("_")], n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        return f"vLLM's AsyncEngineArgs has no field {name!r}{hint}"
    return None


def async_engine_arg_fields(args_class: type) -> frozenset[str]:
    """The field names of vLLM's AsyncEngineArgs (a dataclass)."""
    import dataclasses

    return frozenset(f.name for f in dataclasses.fields(args_class))


KV_TOPIC = "kv"


def kv_events_endpoints(endpoint: str) -> tuple[str, str]:
    """(where vLLM's publisher binds, where our subscriber connects) for ``endpoint``.
    Both vLLM's publisher and our subscriber would connect to any other endpoint, and
    then no event ever arrives: refused here."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint, endpoint
    if endpoint.startswith("tcp://*:"):
        return endpoint, endpoint.replace("*", "127.0.0.1", 1)
    raise ValueError(f"vLLM's KV-event publisher binds only ipc://, inproc:// or tcp://*:PORT endpoints, "
                     f"not {endpoint!r}")


def engine_args(model: str, *, served_name: str | None, max_model_len: int | None, gpu_memory_utilization: float,
                enable_lora: bool, max_loras: int, max_lora_rank: int, kv_events_endpoint: str | None,
                kv_events_config: Any, options: VllmEngineOptions | None = None) -> dict[str, Any]:
    """Keyword arguments of vLLM's AsyncEngineArgs for this engine (``kv_events_config``:
    vLLM's KVEventsConfig class; ``options``: the GPU path's, checked by the caller;
    ``max_model_len`` None: the model's own)."""
    events = None
    if kv_events_endpoint:
        events = kv_events_config(enable_kv_cache_events=True, publisher="zmq", topic=KV_TOPIC,
                                  endpoint=kv_events_endpoints(kv_events_endpoint)[0])
    lora = {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": max_lora_rank} if enable_lora else {}
    return dict(model=model, served_model_name=served_name or model, max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                kv_events_config=events, **lora, **(options or VllmEngineOptions()).args())


def pooling_engine_args(model: str, *, served_name: str | None, max_model_len: int | None,
                        gpu_memory_utilization: float, options: VllmEngineOptions | None = None) -> dict[str, Any]:
    """``engine_args`` for a pooling model (vLLM's pooling runner; Embed): no LoRA, no KV events,
    and prefix caching as vLLM decides for the model (off for encoder-only ones such as BERT,
    whose attention is not causal: vLLM warns that forcing it on may give wrong outputs)."""
    args = engine_args(model, served_name=served_name, max_model_len=max_model_len,
                       gpu_memory_utilization=gpu_memory_utilization, enable_lora=False, max_loras=1,
                       max_lora_rank=16, kv_events_endpoint=None, kv_events_config=None, options=options)
    del args["enable_prefix_caching"]
    return {**args, "runner": "pooling"}


def default_kv_events_endpoint(endpoint_id: str) -> str:
    """A local IPC socket, one per model load (a swap may run two engines at once):
    vLLM's publisher binds it (it binds ipc://, inproc:// and wildcard endpoints and
    connects to any other), nothing off this host can reach it."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in endpoint_id)
    return f"ipc://{tempfile.gettempdir()}/llmesh-kv-{safe}-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"

"""The engine's settings against vLLM's own AsyncEngineArgs (vLLM 0.32, the pinned version),
where vLLM is installed (its CPU build, for the real-vLLM tests); tests/unit/test_vllm_engine_args.py
checks the mapping itself without vLLM."""

from __future__ import annotations

import pytest

arg_utils = pytest.importorskip("vllm.engine.arg_utils", reason="vLLM is not installed in this venv")


def test_the_own_settings_name_asyncengineargs_fields():
    from llmesh.engine.backends.vllm_args import OWN_ARGS, async_engine_arg_fields

    fields = async_engine_arg_fields(arg_utils.AsyncEngineArgs)
    assert set(OWN_ARGS) <= fields, set(OWN_ARGS) - fields


def test_settings_build_vllms_engine_args(monkeypatch):
    from vllm.config import KVEventsConfig

    from llmesh.engine.app import vllm_options
    from llmesh.engine.backends.vllm import engine_args
    from llmesh.engine.backends.vllm_args import async_engine_arg_fields
    from llmesh.engine.config import EngineSettings

    settings = EngineSettings(backend="vllm", model="m", vllm_tensor_parallel_size=2, vllm_dtype="float32",
                              vllm_max_num_seqs=8, vllm_quantization="fp8", vllm_engine_args={"enforce_eager": True})
    options = vllm_options(settings)
    options.check(async_engine_arg_fields(arg_utils.AsyncEngineArgs))
    args = arg_utils.AsyncEngineArgs(**engine_args(
        "/models/m", served_name="m", max_model_len=2048, gpu_memory_utilization=0.5, enable_lora=False, max_loras=1,
        max_lora_rank=16, kv_events_endpoint="ipc:///tmp/kv.sock", kv_events_config=KVEventsConfig, options=options))
    assert (args.tensor_parallel_size, args.dtype, args.max_num_seqs, args.quantization, args.enforce_eager) == (
        2, "float32", 8, "fp8", True)
    assert (args.max_model_len, args.gpu_memory_utilization, args.enable_prefix_caching) == (2048, 0.5, True)


def test_a_misspelt_extra_stops_create_before_vllm_loads_anything(tmp_path):
    from llmesh.engine.backends.vllm import VllmBackend
    from llmesh.engine.backends.vllm_args import VllmEngineOptions

    with pytest.raises(ValueError, match="no field 'enforce_eagr' \\(did you mean 'enforce_eager'\\?\\)"):
        VllmBackend.create(str(tmp_path / "no-model"), max_model_len=64,
                           options=VllmEngineOptions(extra={"enforce_eagr": True}))

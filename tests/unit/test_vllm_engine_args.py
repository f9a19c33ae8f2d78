"""The GPU path's engine settings -> vLLM's AsyncEngineArgs keyword arguments, without vLLM:
tensor parallel size, quantization, dtype, max_num_seqs, the GPU memory share, max model length
and extra AsyncEngineArgs checked by field name (tests/component/test_engine_args_real.py
checks the same against vLLM's own AsyncEngineArgs where vLLM is installed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from llmesh.engine.app import VLLM_GENERATE_MAX_MODEL_LEN, vllm_options
from llmesh.engine.backends.vllm import engine_args
from llmesh.engine.backends.vllm_args import OWN_ARGS, VllmEngineOptions, pooling_engine_args
from llmesh.engine.backends.vllm_pooling import serves_pooling
from llmesh.engine.config import EngineSettings

# Field names of vLLM 0.32.0's AsyncEngineArgs (vllm/engine/arg_utils.py), a part: the own
# settings' fields and some a platform passes through.
FIELDS = frozenset(OWN_ARGS) | {"enforce_eager", "kv_cache_dtype", "max_num_batched_tokens", "enable_chunked_prefill",
                                "seed", "block_size", "pipeline_parallel_size", "enable_log_requests",
                                "_api_process_count"}


class _KVEventsConfig(dict):
    """Stands in for vLLM's KVEventsConfig class (keyword arguments in, kept as given)."""


def _args(settings: EngineSettings) -> dict:
    options = vllm_options(settings)
    options.check(FIELDS)
    return engine_args(settings.vllm_model_path or settings.model, served_name=settings.model,
                       max_model_len=settings.vllm_max_model_len or VLLM_GENERATE_MAX_MODEL_LEN,
                       gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
                       enable_lora=settings.vllm_enable_lora, max_loras=settings.vllm_max_loras,
                       max_lora_rank=settings.vllm_max_lora_rank, kv_events_endpoint=None,
                       kv_events_config=_KVEventsConfig, options=options)


def test_default_settings_leave_vllms_defaults():
    args = _args(EngineSettings(backend="vllm", model="m", vllm_model_path="/models/m"))
    assert args == {"model": "/models/m", "served_model_name": "m", "max_model_len": 4096,
                    "gpu_memory_utilization": 0.85, "enable_prefix_caching": True, "kv_events_config": None,
                    "enable_lora": True, "max_loras": 4, "max_lora_rank": 16,
                    # vLLM's own defaults (EngineArgs 0.32): one GPU, the model's dtype and
                    # quantization, the device's max_num_seqs
                    "tensor_parallel_size": 1, "quantization": None, "dtype": "auto", "max_num_seqs": None,
                    "runner": "generate"}


def test_gpu_settings_from_the_environment_reach_the_engine_args(monkeypatch):
    for name, value in {"BACKEND": "vllm", "MODEL": "qwen", "VLLM_MODEL_PATH": "/models/qwen",
                        "VLLM_TENSOR_PARALLEL_SIZE": "4", "VLLM_QUANTIZATION": "awq", "VLLM_DTYPE": "bfloat16",
                        "VLLM_MAX_NUM_SEQS": "128", "VLLM_GPU_MEMORY_UTILIZATION": "0.9",
                        "VLLM_MAX_MODEL_LEN": "32768", "VLLM_ENABLE_LORA": "false",
                        "VLLM_ENGINE_ARGS": '{"enforce_eager": true, "kv_cache_dtype": "fp8", "seed": 7}'}.items():
        monkeypatch.setenv(f"LLMESH_ENGINE_{name}", value)
    args = _args(EngineSettings())
    assert args == {"model": "/models/qwen", "served_model_name": "qwen", "max_model_len": 32768,
                    "gpu_memory_utilization": 0.9, "enable_prefix_caching": True, "kv_events_config": None,
                    "tensor_parallel_size": 4, "quantization": "awq", "dtype": "bfloat16", "max_num_seqs": 128,
                    "runner": "generate", "enforce_eager": True, "kv_cache_dtype": "fp8", "seed": 7}


def test_kv_events_and_lora_stay_as_they_were():
    settings = EngineSettings(backend="vllm", model="m", vllm_max_lora_rank=64, vllm_max_loras=2)
    args = engine_args("m", served_name=None, max_model_len=64, gpu_memory_utilization=0.5, enable_lora=True,
                       max_loras=2, max_lora_rank=64, kv_events_endpoint="tcp://*:5557",
                       kv_events_config=_KVEventsConfig, options=vllm_options(settings))
    assert args["kv_events_config"] == {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                                        "endpoint": "tcp://*:5557"}
    assert (args["max_loras"], args["max_lora_rank"], args["served_model_name"]) == (2, 64, "m")


def test_an_extra_name_vllm_lacks_is_an_error_naming_it_and_the_nearest_field():
    options = VllmEngineOptions(extra={"enforce_eagr": True, "kv_cache_dtype": "fp8", "no_such_knob": 1})
    with pytest.raises(ValueError) as err:
        options.check(FIELDS)
    assert str(err.value) == ("LLMESH_ENGINE_VLLM_ENGINE_ARGS: vLLM's AsyncEngineArgs has no field 'enforce_eagr' "
                              "(did you mean 'enforce_eager'?); vLLM's AsyncEngineArgs has no field 'no_such_knob'")
    with pytest.raises(ValueError, match="no field '_api_process_count'"):
        VllmEngineOptions(extra={"_api_process_count": 2}).check(FIELDS)  # vLLM's private fields are not options


@pytest.mark.parametrize(("name", "setting"), [("tensor_parallel_size", "LLMESH_ENGINE_VLLM_TENSOR_PARALLEL_SIZE"),
                                               ("max_num_seqs", "LLMESH_ENGINE_VLLM_MAX_NUM_SEQS"),
                                               ("model", "LLMESH_ENGINE_VLLM_MODEL_PATH"),
                                               ("kv_events_config", "LLMESH_ENGINE_VLLM_KV_EVENTS"),
                                               ("runner", "LLMESH_ENGINE_VLLM_RUNNER")])
def test_an_extra_that_an_own_setting_sets_is_refused_naming_that_setting(name, setting):
    with pytest.raises(ValueError, match=f"'{name}' is set by {setting}"):
        VllmEngineOptions(extra={name: 1}).check(FIELDS)


def test_bad_gpu_settings_are_refused():
    for bad in ({"vllm_dtype": "fp64"}, {"vllm_tensor_parallel_size": 0}, {"vllm_max_num_seqs": 0},
                {"vllm_quantization": ""}, {"vllm_engine_args": ["enforce_eager"]}, {"vllm_runner": "embed"},
                {"vllm_max_model_len": 8}):
        with pytest.raises(ValidationError):
            EngineSettings(backend="vllm", **bad)


def test_a_pooling_model_gets_vllms_pooling_runner_its_own_window_and_no_lora_kv_events_or_forced_prefix_cache():
    settings = EngineSettings(backend="vllm", model="minilm", vllm_dtype="float32",
                              vllm_engine_args={"enforce_eager": True})
    args = pooling_engine_args("/models/minilm", served_name="minilm", max_model_len=settings.vllm_max_model_len,
                               gpu_memory_utilization=0.5, options=vllm_options(settings, "pooling"))
    assert args == {"model": "/models/minilm", "served_model_name": "minilm", "max_model_len": None,
                    "gpu_memory_utilization": 0.5, "kv_events_config": None, "tensor_parallel_size": 1,
                    "quantization": None, "dtype": "float32", "max_num_seqs": None, "runner": "pooling",
                    "enforce_eager": True}
    capped = pooling_engine_args("/m", served_name=None, max_model_len=128, gpu_memory_utilization=0.5)
    assert (capped["max_model_len"], capped["runner"]) == (128, "pooling")


def test_an_explicit_runner_setting_decides_without_reading_the_model(tmp_path):
    # auto reads the model's sentence-transformers files with vLLM's own rule (tests/component/test_vllm_pooling.py)
    assert serves_pooling(str(tmp_path / "absent"), "pooling")
    assert not serves_pooling(str(tmp_path / "absent"), "generate")
    assert EngineSettings(backend="vllm").vllm_runner == "auto"

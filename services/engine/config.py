"""Engine settings, from LLMESH_ENGINE_* environment variables."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from llmesh.settings import DEFAULT_PORTS, ServiceSettings, default_address


class EngineSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="LLMESH_ENGINE_", extra="ignore", frozen=True)

    port: int = DEFAULT_PORTS["engine"]
    # minilm and llamacpp_embed: embeddings only
    backend: Literal["llamacpp", "sim", "vllm", "minilm", "llamacpp_embed"] = "llamacpp"
    model: str = "smollm2-135m-instruct"
    model_dir: Path = Path("var/models")
    endpoint_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-engine")
    scheduler_address: str | None = default_address("scheduler")
    modelmgr_address: str | None = Field(default=None, description="the model manager, where LoadModel fetches "
                                         "a deployed model's files (llamacpp and vllm backends; `llmesh up`, "
                                         "compose and Helm set it); unset: local models only")
    report_interval_s: float = Field(default=1.0, gt=0)
    route_away_s: float = Field(default=0.0, ge=0, le=60, description="on stop: after telling the scheduler "
                                "it is draining, keep accepting this long, so requests gateways routed here "
                                "just before they heard still land (the local autoscaler's drain sets it)")
    # Fetching a deployed model from the model manager (no filesystem shared with it).
    fetch_max_bytes: int = Field(default=64 << 30, ge=1, description="the largest model (all its files) "
                                 "LoadModel fetches; a larger one is RESOURCE_EXHAUSTED")
    fetch_timeout_s: float = Field(default=3600.0, gt=0, description="a whole fetch; what arrived is kept and "
                                   "the next load resumes from it")
    fetch_idle_timeout_s: float = Field(default=30.0, gt=0, description="a download stream that sends nothing "
                                        "this long is cut and resumed")
    fetch_attempts: int = Field(default=5, ge=1, description="streams tried per file, each resuming where the "
                                "last one stopped")
    self_test_interval_s: float = Field(default=30.0, gt=0, description="idle self-test and hardware probe")

    # Applied when a request leaves them unset (as vLLM applies a model's generation
    # config). 0.2 / 0.9 is what SmolLM2's authors recommend; OpenAI's own default
    # of 1.0 / 1.0 makes a 135M model ramble.
    default_temperature: float = Field(default=0.2, ge=0, le=2)
    default_top_p: float = Field(default=0.9, gt=0, le=1)

    # Sequences decoded together (llamacpp: KV slots, each holding n_ctx tokens).
    max_running: int = Field(default=16, ge=1)
    max_waiting: int = Field(default=32, ge=0)

    # llamacpp
    n_ctx: int = Field(default=2048, ge=16, description="context window; capped by the model's own")
    n_threads: int = Field(default=2, ge=1)
    n_batch: int = Field(default=512, ge=1, description="tokens per decode step, prompt chunks included")
    embed_pooling: Literal["model", "mean", "cls", "last"] = Field(
        default="model", description="llamacpp_embed: how a GGUF's token vectors make one; model: as the GGUF "
        "says (a generative model's GGUF names none: choose one)")
    unified_kv: bool = Field(default=False, description="one KV pool: busy sequences share a common prefix, "
                             "but every token attends over all cells (slower beyond a few sequences)")

    # vllm (GPU; the optional `vllm` extra)
    vllm_model_path: str | None = Field(default=None, description="HF model directory or id; served as `model`")
    vllm_runner: Literal["auto", "generate", "pooling"] = Field(
        default="auto", description="what a vllm engine serves: generate (Generate: chat and completions) or "
        "pooling (Embed: an embedding model on vLLM's pooling runner, with the pooling and normalization the "
        "model's sentence-transformers files state); auto: pooling for a sentence-transformers model (its "
        "modules.json names a Pooling module, as vLLM's own auto decides), else generate")
    vllm_max_model_len: int | None = Field(default=None, ge=16, description="vLLM's max_model_len: the tokens "
                                           "of a sequence; unset: 4096 when generating, the model's own limit "
                                           "when pooling (all-MiniLM-L6-v2: 256); an embedding input over it "
                                           "is refused")
    vllm_gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1, description="the GPU memory share "
                                               "vLLM reserves; a model swap that cannot fit two unloads first")
    vllm_kv_events: bool = Field(default=True, description="relay vLLM's KV-cache events to the scheduler")
    vllm_kv_events_endpoint: str | None = Field(default=None, description="where vLLM's publisher binds: "
                                                "ipc://PATH, inproc://NAME or tcp://*:PORT (default: an IPC socket)")
    vllm_enable_lora: bool = Field(default=True, description="serve LoRA adapters (LoadModel with adapter_path)")
    vllm_max_lora_rank: int = Field(default=16, description="the highest adapter rank vLLM takes: "
                                    "1, 8, 16, 32, 64, 128, 256, 320 or 512 (vLLM's choices)")
    vllm_max_loras: int = Field(default=4, ge=1, description="adapters in one batch")
    vllm_tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs of one node the model is split "
                                           "over (vLLM's tensor_parallel_size)")
    vllm_quantization: str | None = Field(default=None, min_length=1, description="vLLM's quantization method "
                                          "(awq, gptq, fp8, ...); unset: as the model's config says")
    vllm_dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(
        default="auto", description="weights' and activations' type; auto: the model's (fp16 for fp32 models)")
    vllm_max_num_seqs: int | None = Field(default=None, ge=1, description="sequences vLLM batches in a step; "
                                          "unset: vLLM's default for the device")
    vllm_engine_args: dict[str, Any] = Field(default={}, description="more of vLLM's AsyncEngineArgs "
                                             "by field name, a JSON object (e.g. {\"enforce_eager\": true}); a "
                                             "name AsyncEngineArgs lacks, or one a setting above sets, stops the "
                                             "engine at startup, naming it")

    @field_validator("vllm_max_lora_rank")
    @classmethod
    def _lora_rank(cls, v: int) -> int:
        if v not in (1, 8, 16, 32, 64, 128, 256, 320, 512):
            raise ValueError("vLLM takes a max LoRA rank of 1, 8, 16, 32, 64, 128, 256, 320 or 512")
        return v

    @field_validator("vllm_kv_events_endpoint")
    @classmethod
    def _bindable(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("ipc://", "inproc://", "tcp://*:")):
            raise ValueError("vLLM's KV-event publisher binds only ipc://PATH, inproc://NAME or tcp://*:PORT; "
                             "at any other endpoint it and the subscriber both connect and no event arrives")
        return v

    # sim
    sim_context_length: int = Field(default=4096, ge=16)
    sim_prefill_ms_per_token: float = Field(default=0.0, ge=0)
    sim_decode_ms_per_token: float = Field(default=5.0, ge=0, description="a decode step's fixed cost")
    sim_decode_ms_per_seq: float = Field(default=0.0, ge=0, description="added per sequence in a step")
    sim_kv_blocks: int = Field(default=4096, ge=1, description="KV cache size in 16-token blocks")
    sim_piggyback: bool = Field(default=False, description="a GPU's step: it lasts the longer of its decode and "
                                "its prefill, not their sum (a CPU's)")
    sim_output_tokens: int = Field(default=64, ge=1)
    sim_profile: Path | None = Field(default=None, description="a profile fitted by `llmesh bench engine "
                                     "--calibrate`; replaces the sim_* timings above")

    # Fault injection: test aids, refused unless fault_injection is on. Never in production.
    fault_injection: bool = Field(default=False, description="allow fault-injection settings (sim_die_on); tests "
                                  "only, never in production")
    sim_die_on: str | None = Field(default=None, min_length=1, description="fault injection (tests only; needs "
                                   "LLMESH_ENGINE_FAULT_INJECTION=true): a sim engine whose prompt contains this "
                                   "text kills its own process (SIGKILL) before answering")

    @model_validator(mode="after")
    def _fault_injection_is_asked_for(self) -> EngineSettings:
        if self.sim_die_on is not None and not self.fault_injection:
            raise ValueError("sim_die_on is a fault-injection aid for tests: it needs "
                             "LLMESH_ENGINE_FAULT_INJECTION=true as well")
        return self

"""Model manager settings, from LLMESH_MODELMGR_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmesh.settings import DEFAULT_PORTS, ServiceSettings, default_address


class ModelMgrSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="LLMESH_MODELMGR_", extra="ignore", frozen=True)

    port: int = DEFAULT_PORTS["modelmgr"]
    model_dir: Path = Field(default=Path("var/models"), description="where Deploy publishes a version's files; "
                            "engines fetch them from here over gRPC (or share the folder)")
    store_dir: Path = Field(default=Path("var/modelstore"), description="content-addressed artifact blobs")
    database_url: str = Field(default="sqlite:///var/modelmgr/registry.db",
                              description="SQLAlchemy URL; production: postgresql+psycopg://...")
    scheduler_address: str = default_address("scheduler")

    fetch_max_streams: int = Field(default=8, ge=1, description="artifact downloads (FetchArtifact) served at "
                                   "once; more are RESOURCE_EXHAUSTED and the engine retries")
    load_timeout_s: float = Field(default=900.0, gt=0, description="deadline of an engine's LoadModel, its "
                                  "fetch of the artifact included (an interrupted fetch resumes on the next deploy)")
    import_max_files: int = Field(default=1000, ge=1, description="files a safetensors directory may hold")
    import_max_bytes: int = Field(default=1 << 40, ge=1, description="bytes a safetensors directory may hold")
    import_max_depth: int = Field(default=4, ge=0, description="folders deep a safetensors directory may go")
    vllm_gpus_per_replica: int = Field(default=1, ge=0, description="GPUs one replica of a safetensors "
                                       "version takes on a vllm engine (its tensor parallel size: engines "
                                       "started with another LLMESH_ENGINE_VLLM_TENSOR_PARALLEL_SIZE are left "
                                       "out); 0: placed by CPU memory (vLLM's CPU build)")

    warmup_generations: int = Field(default=3, ge=0, description="real generations before a replica is ready")
    memory_budget: float = Field(default=0.85, gt=0, le=1, description="share of an engine's free memory a "
                                 "variant may need")
    memory_overhead: float = Field(default=0.25, ge=0, description="KV cache and buffers, as a share of the weights")
    settle_s: float = Field(default=1.5, ge=0, description="time the mesh takes to apply a config change")
    drain_timeout_s: float = Field(default=60.0, gt=0)
    golden_set: Path = Field(default=Path(__file__).with_name("golden.jsonl"),
                             description="JSON lines of {prompt, expected?} for the eval gate")
    # Measured with the default golden set: SmolLM2 Q8_0 against the shipped Q4_1 scores ~0.53,
    # a Q2_K quantization (too lossy for 135M parameters) ~0.22.
    eval_threshold: float = Field(default=0.4, ge=0, le=1, description="least mean similarity to pass")
    eval_min_exact_match: float = Field(default=0.0, ge=0, le=1)
    eval_max_tokens: int = Field(default=32, ge=1)

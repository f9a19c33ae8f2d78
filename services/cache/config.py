"""Cache settings, from LLMESH_CACHE_* environment variables. What is cached, for how
long and how (exact or semantic, threshold) is live config (the ``cache`` section)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmesh.settings import DEFAULT_PORTS, ServiceSettings


class CacheSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="LLMESH_CACHE_", extra="ignore", frozen=True)

    port: int = DEFAULT_PORTS["cache"]
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = Field(default="llmesh:cache", min_length=1, description="prefix of every Redis key")
    max_entries_per_tenant: int = Field(default=10_000, ge=1)
    store_budget_s: float = Field(default=0.015, gt=0, description="per store call; over it the call is a miss")
    store_pause_s: float = Field(default=1.0, ge=0, description="after a store failure, bypass it this long")
    embed_model_dir: Path = Path("var/models/all-minilm-l6-v2")
    hnsw_min: int = Field(default=2000, ge=1, description="a scope this large moves from exact search to HNSW")

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
    embed_model_dir: Path = Path("var/models/all-minilm-l6-v2")  # the default embedder (live config: cache.embedder)
    embed_key_dir: Path | None = Field(default=None, description="the only directory an embedding endpoint's "
                                       "api_key_file is read from (a relative one: inside it); none: no file")
    embed_key_envs: str = Field(default="", pattern=r"^[A-Za-z_][A-Za-z0-9_]*(,[A-Za-z_][A-Za-z0-9_]*)*$|^$",
                                description="comma-separated environment variables an embedding endpoint's "
                                "api_key_env may name; empty: none")
    hnsw_min: int = Field(default=2000, ge=1, description="a scope this large moves from exact search to HNSW")

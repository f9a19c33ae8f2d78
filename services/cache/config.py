"""Cache settings, from LLMESH_CACHE_* environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmesh.settings import DEFAULT_PORTS, ServiceSettings


class CacheSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="LLMESH_CACHE_", extra="ignore", frozen=True)

    port: int = DEFAULT_PORTS["cache"]
    max_entries: int = Field(default=10_000, ge=1)
    ttl_s: float = Field(default=3600.0, gt=0)

"""Gateway settings, from LLMESH_GATEWAY_* environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmesh.settings import DEFAULT_PORTS, ServiceSettings, default_address


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="LLMESH_GATEWAY_", extra="ignore", frozen=True)

    port: int = DEFAULT_PORTS["gateway"]
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=DEFAULT_PORTS["gateway_http"], ge=0, le=65535)
    scheduler_address: str = default_address("scheduler")
    modelmgr_address: str | None = default_address("modelmgr")
    cache_address: str | None = default_address("cache")
    cache_budget_s: float = Field(default=0.02, gt=0, description="longest a cache lookup may take; then it is a miss")
    request_timeout_s: float = Field(default=600.0, gt=0, description="longest a request may take")
    catalog_refresh_s: float = Field(default=10.0, gt=0)

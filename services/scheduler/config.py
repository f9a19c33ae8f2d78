"""Scheduler settings, from LLMESH_SCHEDULER_* environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmesh.settings import DEFAULT_PORTS, ServiceSettings


class SchedulerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="LLMESH_SCHEDULER_", extra="ignore", frozen=True)

    port: int = DEFAULT_PORTS["scheduler"]
    stale_after_s: float = Field(default=3.0, gt=0, description="no report for this long: unhealthy")

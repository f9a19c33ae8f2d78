"""Scheduler settings, from LLMESH_SCHEDULER_* environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmesh.settings import DEFAULT_PORTS, ServiceSettings


class SchedulerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="LLMESH_SCHEDULER_", extra="ignore", frozen=True)

    port: int = DEFAULT_PORTS["scheduler"]
    stale_after_s: float = Field(default=3.0, gt=0, description="no report for this long: unhealthy")
    ecc_quiet_s: float = Field(default=300.0, gt=0, description="a node whose ECC errors rose gets no new "
                               "work until its count has stayed put this long")
    latency_drift_factor: float = Field(default=3.0, gt=1, description="self-test latency this many times its "
                                        "peers' median: degraded")
    latency_drift_min_ms: float = Field(default=50.0, ge=0, description="... and at least this far above it")
    latency_drift_min_peers: int = Field(default=2, ge=1, description="latency is judged against peers only when "
                                         "at least this many (same backend) have measured theirs")
    autoscale_interval_s: float = Field(default=1.0, gt=0, description="how often the autoscaler decides (also "
                                        "at once when a gateway reports held requests)")
    demand_ttl_s: float = Field(default=3.0, gt=0, description="a gateway's held-request report counts this long")

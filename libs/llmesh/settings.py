"""Typed settings shared by every service. Each service subclasses ``ServiceSettings``
with its own env prefix (``LLMESH_<SERVICE>_``); values come from the environment."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(ge=0, le=65535)
    log_level: str = "info"
    grace_s: float = Field(default=10.0, ge=0, description="time in-flight calls get to finish on stop")
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    metrics_port: int | None = Field(default=None, ge=0, le=65535,
                                     description="serve Prometheus /metrics on host:port; off when unset")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class MeshSettings(BaseSettings):
    """What every service of one mesh shares, from LLMESH_* variables: how services
    find each other and where the live config lives. The defaults need nothing
    running: static addresses and a YAML file."""
    model_config = SettingsConfigDict(env_prefix="LLMESH_", extra="ignore", frozen=True)

    discovery: Literal["static", "etcd", "consul"] = "static"
    etcd_address: str = "127.0.0.1:2379"
    consul_address: str = "127.0.0.1:8500"
    discovery_prefix: str = "/llmesh/services"
    registry_ttl_s: int = Field(default=5, ge=1, description="etcd lease: a dead service leaves after this")
    config_backend: Literal["none", "file", "etcd"] = "file"
    config_file: Path = Path("llmesh.yaml")
    config_prefix: str = "/llmesh/config"
    state_dir: Path = Field(default=Path("var/state"), description="config snapshots live here")
    redis_url: str | None = Field(default=None, description="shared limits, keys and usage; unset: in-process")


# Default ports of a one-machine mesh; every one can be overridden by env.
DEFAULT_PORTS = {
    "gateway": 50051,
    "gateway_http": 8080,
    "scheduler": 50052,
    "modelmgr": 50053,
    "cache": 50054,
    "engine": 50061,
}


def default_address(service: str) -> str:
    return f"127.0.0.1:{DEFAULT_PORTS[service]}"

"""Typed settings shared by every service. Each service subclasses ``ServiceSettings``
with its own env prefix (``LLMESH_<SERVICE>_``); values come from the environment."""

from __future__ import annotations

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

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


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

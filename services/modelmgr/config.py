"""Model manager settings, from LLMESH_MODELMGR_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import SettingsConfigDict

from llmesh.settings import DEFAULT_PORTS, ServiceSettings


class ModelMgrSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="LLMESH_MODELMGR_", extra="ignore", frozen=True)

    port: int = DEFAULT_PORTS["modelmgr"]
    model_dir: Path = Path("var/models")

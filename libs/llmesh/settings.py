"""Typed settings shared by every service. Each service subclasses ``ServiceSettings``
with its own env prefix (``LLMESH_<SERVICE>_``); values come from the environment."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmesh.discovery.base import advertisable
from llmesh.ports import DEFAULT_BIND_WAIT_S


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(ge=0, le=65535)
    log_level: str = "info"
    grace_s: float = Field(default=10.0, ge=0, description="time in-flight calls get to finish on stop")
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    metrics_port: int | None = Field(default=None, ge=0, le=65535,
                                     description="serve Prometheus /metrics on host:port, with GET /healthz and "
                                     "/readyz (200 SERVING / 503 NOT_SERVING, the gRPC health in plaintext); off "
                                     "when unset. Needed with LLMESH_TRUST=tls and Consul discovery: Consul checks "
                                     "that /healthz")
    bind_wait_s: float = Field(default=DEFAULT_BIND_WAIT_S, ge=0, description="how long a listener whose port is "
                               "taken (by another process, or for a moment by an outgoing connection) tries again "
                               "before the service fails naming the port and its holder; a port only closed "
                               "connections hold (TIME_WAIT) is waited for up to 65 s. See docs/operations.md, Ports")
    advertise_address: str | None = Field(
        default=None, description="host:port other hosts reach this service at, as registered in discovery "
        "(and, for an engine, handed to gateways); needed when `host` is 0.0.0.0 or ::. Default: the bound address")

    @field_validator("advertise_address")
    @classmethod
    def _dialable(cls, v: str | None) -> str | None:
        return None if v is None else advertisable(v)

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
    # Consul: the address may be http://host:port, https://host:port or host:port (http).
    consul_token: str | None = Field(default=None, description="ACL token for every Consul call; "
                                     "wins over CONSUL_HTTP_TOKEN")
    consul_ca_file: Path | None = Field(default=None, description="CA bundle that signed the agent's HTTPS cert")
    consul_cert_file: Path | None = Field(default=None, description="client certificate (agent verify_incoming)")
    consul_key_file: Path | None = Field(default=None, description="the client certificate's key")
    consul_check_interval_s: float = Field(default=2.0, gt=0, description="health check period (gRPC; an HTTP "
                                           "check of the metrics port's /healthz in trust `tls`)")
    consul_check_timeout_s: float = Field(default=1.0, gt=0, description="a check slower than this fails "
                                          "(Consul's default, 10 s, is longer than the interval)")
    consul_deregister_after_s: int = Field(
        default=60, ge=60, description="Consul removes an instance critical this long; Consul's floor is 60 s "
        "and its reaper runs every 30 s, so routing relies on the passing-only filter, not on this")
    consul_wait_s: float = Field(default=30.0, gt=0, le=600, description="blocking query wait (Consul caps at 10 min)")
    consul_resync_s: float = Field(default=5.0, gt=0, description="how often registrations are checked "
                                   "against the agent's (re-registered if an agent restart lost them)")
    config_backend: Literal["none", "file", "etcd"] = "file"
    config_file: Path = Path("llmesh.yaml")
    config_prefix: str = "/llmesh/config"
    state_dir: Path = Field(default=Path("var/state"), description="config snapshots live here")
    redis_url: str | None = Field(default=None, description="shared limits, keys and usage; unset: in-process")
    trust: Literal["local", "token", "tls"] = Field(
        default="local", description="how internal calls prove who calls: `tls` (mutual TLS on every gRPC port, "
        "the caller named by its certificate), `token` (plaintext gRPC, each call carrying a token signed with the "
        "caller's certificate key, bound to the target and method, short-lived, never replayed), or `local` (the "
        "one-machine mode: no identity asked for, and a service refuses to listen on anything but loopback). "
        "`tls` and `token` check every internal method against its allow-list of caller services")
    tls_ca_file: Path | None = Field(default=None, description="the mesh CA (PEM) that signs every service's "
                                     "certificate; needed for trust `tls` and `token`")
    tls_cert_file: Path | None = Field(default=None, description="this service's certificate (PEM): SAN "
                                       "`<service>.llmesh.internal`, CN the instance (or the service when shared)")
    tls_key_file: Path | None = Field(default=None, description="the certificate's private key (PEM, ECDSA or RSA)")

    @model_validator(mode="after")
    def _client_cert_pair(self) -> MeshSettings:
        if (self.consul_cert_file is None) != (self.consul_key_file is None):
            raise ValueError("LLMESH_CONSUL_CERT_FILE and LLMESH_CONSUL_KEY_FILE go together")
        return self

    @model_validator(mode="after")
    def _trust_files(self) -> MeshSettings:
        if self.trust != "local":
            missing = [f"LLMESH_{name.upper()}" for name in ("tls_ca_file", "tls_cert_file", "tls_key_file")
                       if getattr(self, name) is None]
            if missing:
                raise ValueError(f"LLMESH_TRUST={self.trust} needs the mesh CA and this service's certificate "
                                 f"and key: set {', '.join(missing)}")
        return self


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

"""What the runner hands every service besides its own settings: discovery, live
config and the metrics registry, built from MeshSettings in one place."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.trace import NoOpTracer
from prometheus_client import CollectorRegistry

from llmesh.discovery.base import Follower, Registry, Resolver, fixed
from llmesh.discovery.static import StaticRegistry
from llmesh.liveconfig.live import LiveConfig
from llmesh.liveconfig.stores import ConfigStore, EtcdStore, FileStore
from llmesh.rpc.identity import Credentials, Identity
from llmesh.serving import ServingState
from llmesh.settings import MeshSettings
from llmesh.telemetry import Tracing, build_tracer

if TYPE_CHECKING:
    import aetcd


@dataclass
class Platform:
    settings: MeshSettings
    registry: Registry
    config: LiveConfig
    metrics: CollectorRegistry
    tracing: Tracing = field(default_factory=lambda: Tracing(NoOpTracer()))
    identity: Identity = field(default_factory=lambda: Identity("test"))
    followers: list[Follower] = field(default_factory=list)
    # Whether the app serves: its GrpcServer writes it, the metrics port's /healthz reads it.
    serving: ServingState = field(default_factory=ServingState)

    def resolver(self, service: str, static_address: str) -> Resolver:
        """Where to reach ``service``: the configured address on one machine, else a
        live registered instance, asked for on every (re)connect and answered from a
        watch of the registry (the last known instances while the backend is away)."""
        if self.settings.discovery == "static":
            return fixed(static_address)
        follower = Follower(self.registry, service)
        self.followers.append(follower)
        return follower

    async def close(self) -> None:
        """Stop the watches, then let the registry go (its own keepers included)."""
        for follower in self.followers:
            await follower.close()
        with contextlib.suppress(Exception):
            await self.registry.close()


def _etcd(mesh: MeshSettings) -> aetcd.Client:
    from llmesh.discovery.etcd import etcd_client
    return etcd_client(mesh.etcd_address)


def build_registry(mesh: MeshSettings, etcd: aetcd.Client | None = None) -> Registry:
    """Where services register: etcd, Consul, or nothing to do (static addresses)."""
    if mesh.discovery == "etcd":
        from llmesh.discovery.etcd import EtcdRegistry
        return EtcdRegistry(etcd or _etcd(mesh), prefix=mesh.discovery_prefix, ttl_s=mesh.registry_ttl_s)
    if mesh.discovery == "consul":
        from llmesh.discovery.consul import ConsulRegistry
        return ConsulRegistry(
            mesh.consul_address, token=mesh.consul_token,
            ca_file=str(mesh.consul_ca_file) if mesh.consul_ca_file else None,
            cert_file=str(mesh.consul_cert_file) if mesh.consul_cert_file else None,
            key_file=str(mesh.consul_key_file) if mesh.consul_key_file else None,
            check_interval_s=mesh.consul_check_interval_s, check_timeout_s=mesh.consul_check_timeout_s,
            deregister_after_s=mesh.consul_deregister_after_s, wait_s=mesh.consul_wait_s,
            resync_s=mesh.consul_resync_s)
    return StaticRegistry()


def build_platform(service: str, mesh: MeshSettings) -> Platform:
    etcd = _etcd(mesh) if "etcd" in (mesh.discovery, mesh.config_backend) else None
    registry = build_registry(mesh, etcd)
    store: ConfigStore | None = None
    if mesh.config_backend == "etcd":
        store = EtcdStore(etcd, mesh.etcd_address, mesh.config_prefix)
    elif mesh.config_backend == "file":
        store = FileStore(mesh.config_file)
    metrics = CollectorRegistry()
    # A file is its own durable copy; an etcd-backed service keeps a snapshot to start from.
    snapshot = mesh.state_dir / f"{service}-config.yaml" if mesh.config_backend == "etcd" else None
    config = LiveConfig(store, metrics, service, snapshot=snapshot)
    return Platform(mesh, registry, config, metrics, build_tracer(service), identity=service_identity(service, mesh))


def service_identity(service: str, mesh: MeshSettings) -> Identity:
    """This process's identity in the mesh's trust (IdentityError when its files are missing or wrong)."""
    if mesh.trust == "local" or not (mesh.tls_ca_file and mesh.tls_cert_file and mesh.tls_key_file):
        return Identity(service, mesh.trust)  # "tls"/"token" without files: Identity says what is missing
    return Identity(service, mesh.trust, Credentials.load(mesh.tls_ca_file, mesh.tls_cert_file, mesh.tls_key_file))


def standalone_platform(service: str) -> Platform:
    """For an app built outside the runner (tests): static discovery, no live config."""
    mesh = MeshSettings(discovery="static", config_backend="none", trust="local")
    platform = build_platform(service, mesh)
    platform.tracing = Tracing(NoOpTracer())
    return platform

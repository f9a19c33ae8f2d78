"""Client channels with the options every hop uses, and the mesh's identity on them."""

from __future__ import annotations

import grpc

from llmesh.rpc.identity import Identity, client_interceptors
from llmesh.rpc.pki import service_dns

CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


def mesh_channel(address: str, target_service: str, identity: Identity | None = None) -> grpc.aio.Channel:
    """A channel to ``target_service`` (engine, scheduler, ...) at ``address``, as ``identity``:
    mutual TLS verifying the server as ``<target_service>.llmesh.internal`` in "tls" trust, a
    signed token on every call in "token" trust, plaintext and no identity in "local" trust
    (or without an identity: tests, and tools outside the mesh)."""
    credentials = identity.channel_credentials() if identity else None
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS,
                                         interceptors=client_interceptors(identity, target_service))
    options = (*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", service_dns(target_service)))
    return grpc.aio.secure_channel(address, credentials, options=options)

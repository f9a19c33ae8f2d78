"""Client channels with the options every hop uses."""

from __future__ import annotations

import grpc

from llmesh.rpc.identity import Identity, client_interceptors

CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


def insecure_channel(address: str, identity: Identity | None = None) -> grpc.aio.Channel:
    """Every call on it carries ``identity``'s service token when the mesh has a secret."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=client_interceptors(identity))

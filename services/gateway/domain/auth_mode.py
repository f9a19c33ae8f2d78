"""Whether the gateway may run in local mode (any credential, or none, is the tenant
``default``) or requires credentials: decided once, at start, from settings alone.

Never from the key store's contents: a flushed or evicted Redis, or a fresh replica
with an empty store, must not open the door. Local mode needs every one of: both
listeners (HTTP and gRPC) on loopback, no Redis key store, no JWT, and
``require_auth`` unset. In local mode the first API key in the (file) store still ends
it; the store can close the door, never open it off loopback."""

from __future__ import annotations

from dataclasses import dataclass

from llmesh.netaddr import is_loopback


@dataclass(frozen=True, slots=True)
class AuthMode:
    local: bool
    why: tuple[str, ...]  # why credentials are required; empty in local mode

    def describe(self) -> str:
        if self.local:
            return ("local mode: both listeners are on loopback, no Redis, no JWT, require_auth unset; "
                    "callers need no credentials until the first API key exists")
        return "credentials required: " + "; ".join(self.why)


def auth_mode(*, http_host: str, grpc_host: str, redis: bool, jwt: bool, require_auth: bool) -> AuthMode:
    why = [f"the {name} listener binds {host}, not loopback"
           for name, host in (("HTTP", http_host), ("gRPC", grpc_host)) if not is_loopback(host)]
    if redis:
        why.append("API keys are in Redis (LLMESH_REDIS_URL)")
    if jwt:
        why.append("JWT is configured (LLMESH_GATEWAY_JWKS_FILE / _URL)")
    if require_auth:
        why.append("LLMESH_GATEWAY_REQUIRE_AUTH is set")
    return AuthMode(local=not why, why=tuple(why))


def shared_store_problem(others: int, redis: bool) -> str | None:
    """Why this gateway must not start beside ``others`` registered gateways, or None:
    keys in a store of its own (a file in the pod) would differ from replica to replica,
    so a key made on one would be unknown to the next."""
    if others and not redis:
        return (f"{others} other gateway instance(s) are registered in discovery and this gateway keeps API keys "
                "in a store of its own; replicas must share one key store: set LLMESH_REDIS_URL "
                "(or run a single gateway replica)")
    return None

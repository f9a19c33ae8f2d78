"""Service identity on internal gRPC calls: who may call the admin RPCs.

A caller proves it belongs to the mesh with a short-lived token in the call's
metadata: ``v1.<service>.<expiry>.<HMAC-SHA256 of the rest>`` keyed by a secret
every service of the mesh reads from a file. A server refuses its admin methods
(model load/unload, registry writes, endpoint registration) without a valid one.
``local_trust`` is the explicit one-machine mode: admin methods are open, and a
server in this mode listens on a loopback address or does not start."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from collections.abc import AsyncIterable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from llmesh.errors import PermissionDenied, Unauthenticated

TOKEN_KEY = "x-llmesh-service-token"
TOKEN_TTL_S = 60.0
MIN_SECRET_BYTES = 32
ADMIN_METHODS = frozenset({
    "/llmesh.v1.Engine/LoadModel", "/llmesh.v1.Engine/UnloadModel",
    "/llmesh.v1.Scheduler/Report", "/llmesh.v1.Scheduler/ReportDemand", "/llmesh.v1.Cache/Invalidate",
    *(f"/llmesh.v1.ModelManager/{m}" for m in (
        "ImportModel", "QuantizeVersion", "Deploy", "Promote", "Rollback", "ArchiveVersion", "Evaluate")),
})


class IdentityError(ValueError):
    pass


def read_secret(path: Path) -> bytes:
    secret = path.read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise IdentityError(f"the service secret in {path} is {len(secret)} bytes; at least "
                            f"{MIN_SECRET_BYTES} are needed (e.g. `openssl rand -hex 32 > {path}`)")
    return secret


def _mac(secret: bytes, claim: str) -> str:
    return hmac.new(secret, claim.encode(), hashlib.sha256).hexdigest()


def mint(secret: bytes, service: str, now: float, ttl_s: float = TOKEN_TTL_S) -> str:
    claim = f"v1.{service}.{int(now + ttl_s)}"
    return f"{claim}.{_mac(secret, claim)}"


def verify(secret: bytes, token: str, now: float, ttl_s: float = TOKEN_TTL_S) -> str:
    """The calling service's name, or Unauthenticated."""
    claim, _, mac = token.rpartition(".")
    parts = claim.split(".")
    if len(parts) != 3 or parts[0] != "v1" or not parts[2].isdigit():
        raise Unauthenticated("malformed service token", reason="invalid_service_token")
    if not hmac.compare_digest(mac, _mac(secret, claim)):
        raise Unauthenticated("service token signature does not match", reason="invalid_service_token")
    expiry = int(parts[2])
    if expiry < now or expiry > now + ttl_s + 5:
        raise Unauthenticated("service token expired or not yet valid", reason="expired_service_token")
    return parts[1]


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Identity:
    """This process's identity (``service``) and the mesh's trust mode."""
    service: str
    secret: bytes | None = None
    local_trust: bool = False
    clock: Callable[[], float] = time.time

    def token(self) -> str | None:
        return mint(self.secret, self.service, self.clock()) if self.secret else None

    def check_bind(self, address: str) -> None:
        if self.local_trust and not self.secret and not is_loopback(address):
            raise IdentityError(f"local trust (LLMESH_LOCAL_TRUST) opens the admin RPCs to every caller, so it "
                                f"needs a loopback address; {address} is not (set LLMESH_SERVICE_SECRET_FILE)")

    def authorize(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """Raises unless the caller may call ``method``."""
        if method not in ADMIN_METHODS:
            return
        token = next((v for k, v in metadata or () if k == TOKEN_KEY and isinstance(v, str)), None)  # a text key
        if self.secret:
            if token is None:
                raise Unauthenticated(f"{method} needs a service token", reason="service_identity_required")
            verify(self.secret, token, self.clock())
            return
        if not self.local_trust:
            raise PermissionDenied(f"{method} is refused: this service has no service secret "
                                   "(LLMESH_SERVICE_SECRET_FILE) and is not in local trust mode",
                                   reason="service_identity_required")


class _WithToken:
    """Adds a fresh service token to every call. grpc.aio files an interceptor under
    the first call kind it implements, so there is one class per kind."""

    def __init__(self, identity: Identity):
        self._identity = identity

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        token = self._identity.token()
        if token is not None:  # always: these interceptors are installed only with a secret
            metadata.add(TOKEN_KEY, token)
        # ClientCallDetails is a namedtuple at runtime; its stub does not say so.
        replaced: grpc.aio.ClientCallDetails = details._replace(metadata=metadata)  # type: ignore[attr-defined]
        return replaced


class _UnaryUnary(_WithToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStream(_WithToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnary(_WithToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                                     request_iterator: AsyncIterable[Any] | Iterable[Any]) -> Any:
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_WithToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                                      request_iterator: AsyncIterable[Any] | Iterable[Any]) -> Any:
        return await continuation(self._details(details), request_iterator)


def client_interceptors(identity: Identity | None) -> list[grpc.aio.ClientInterceptor]:
    if not (identity and identity.secret):
        return []
    return [kind(identity) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]

"""Who is calling, on every internal gRPC call, and whether the method allows it.

The mesh's trust (LLMESH_TRUST) is one of:

- ``tls``: mutual TLS on every port. The caller's identity is its certificate (SAN
  ``<service>.llmesh.internal``, CN the instance), which gRPC has checked against the
  mesh CA. grpcio cannot request a client certificate without requiring it, so a
  caller without one fails the TLS handshake (the client sees UNAVAILABLE), before
  any method or status code is involved.
- ``token``: plaintext gRPC; every call carries a token signed with the caller's
  certificate key, bound to the target service, the method, a short expiry and a
  nonce (``llmesh.rpc.tokens``). No token: UNAUTHENTICATED.
- ``local``: the explicit one-machine mode. No identity is asked for, and a server in
  this mode listens on a loopback address or does not start.

Then the method's allow-list (``llmesh.rpc.policy``): a caller service it does not
name gets PERMISSION_DENIED. Servicers read the verified caller from ``caller``."""

from __future__ import annotations

import base64
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from llmesh.errors import PermissionDenied, Unauthenticated
from llmesh.netaddr import is_loopback
from llmesh.rpc import policy
from llmesh.rpc.pki import PkiError, Principal, read_principal, service_dns
from llmesh.rpc.tokens import CERT_KEY, TOKEN_KEY, TokenSigner, TokenVerifier, load_private_key

Trust = Literal["local", "token", "tls"]
TLS_PEER_CACHE = 1024

# The verified caller of the call being served (None: local trust, or a server without identity checks).
caller: ContextVar[Principal | None] = ContextVar("llmesh.rpc.identity.caller", default=None)

__all__ = ["CERT_KEY", "TOKEN_KEY", "Credentials", "Identity", "IdentityError", "Principal", "Trust", "caller"]


class IdentityError(ValueError):
    pass


@dataclass(frozen=True)
class Credentials:
    """The mesh CA and this process's certificate and key (PEM)."""
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def load(cls, ca_file: Path, cert_file: Path, key_file: Path) -> Credentials:
        try:
            return cls(ca_file.read_bytes(), cert_file.read_bytes(), key_file.read_bytes())
        except OSError as exc:
            raise IdentityError(f"cannot read the mesh's TLS files: {exc}") from None

    @property
    def principal(self) -> Principal:
        return read_principal(self.cert_pem)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Identity:
    """This process's identity (``service``) and the mesh's trust mode: the checks a
    server makes and the credentials a client presents."""

    def __init__(self, service: str, trust: Trust = "local", credentials: Credentials | None = None,
                 clock: Callable[[], float] = time.time):
        self.service = service
        self.trust = trust
        self.credentials = credentials
        self.principal: Principal | None = None  # this process's, from its certificate ("tls", "token")
        self._signer: TokenSigner | None = None
        self._verifier: TokenVerifier | None = None
        self._peers: OrderedDict[bytes, Principal] = OrderedDict()
        if trust == "local":
            return
        if credentials is None:
            raise IdentityError(f"LLMESH_TRUST={trust} needs the mesh CA and this service's certificate and key "
                                "(LLMESH_TLS_CA_FILE, LLMESH_TLS_CERT_FILE, LLMESH_TLS_KEY_FILE)")
        try:
            principal = credentials.principal
            ca = x509.load_pem_x509_certificate(credentials.ca_pem)
            cert = x509.load_pem_x509_certificate(credentials.cert_pem)
            key = load_private_key(credentials.key_pem)
        except (ValueError, PkiError) as exc:
            raise IdentityError(f"the mesh's TLS files are not usable: {exc}") from None
        if principal.service != service:
            raise IdentityError(f"this is the {service} service, but its certificate names "
                                f"{service_dns(principal.service)}")
        self.principal = principal
        self._signer = TokenSigner(principal, key, cert.public_bytes(serialization.Encoding.DER), clock)
        self._verifier = TokenVerifier(ca, clock)

    # -- serving side

    def check_bind(self, address: str) -> None:
        if self.trust == "local" and not is_loopback(address.rsplit(":", 1)[0]):
            raise IdentityError(f"local trust (LLMESH_TRUST=local) asks no caller for an identity, so it needs a "
                                f"loopback address; {address} is not (set LLMESH_TRUST=tls or token)")

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Mutual TLS (a client certificate signed by the mesh CA required) in "tls" trust."""
        if self.trust != "tls" or self.credentials is None:
            return None
        c = self.credentials
        return grpc.ssl_server_credentials([(c.key_pem, c.cert_pem)], root_certificates=c.ca_pem,
                                           require_client_auth=True)

    def authenticate(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> Principal | None:
        """The verified caller of ``method`` once its policy allows it; None in local trust and
        on open methods. Raises Unauthenticated or PermissionDenied."""
        if self.trust == "local" or policy.is_open(method):
            return None
        principal = self._tls_peer(context) if self.trust == "tls" else self._token_caller(method, context)
        if principal.service not in policy.allowed_callers(method):
            raise PermissionDenied(f"{method} is not open to the {principal.service} service",
                                   reason="service_not_allowed")
        return principal

    def _tls_peer(self, context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
        pem = next(iter(context.auth_context().get("x509_pem_cert") or ()), None)
        if pem is None:  # cannot happen with require_client_auth; fail closed anyway
            raise Unauthenticated("the call has no client certificate", reason="service_identity_required")
        principal = self._peers.get(pem)
        if principal is None:
            try:
                principal = read_principal(pem)
            except (ValueError, PkiError) as exc:
                raise Unauthenticated(f"the client certificate names no mesh service: {exc}",
                                      reason="service_identity_required") from None
            self._peers[pem] = principal
            if len(self._peers) > TLS_PEER_CACHE:
                self._peers.popitem(last=False)
        return principal

    def _token_caller(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
        token = cert = None
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_KEY:
                token = _text(value)
            elif key == CERT_KEY:
                cert = _text(value)
        if token is None or cert is None:
            raise Unauthenticated(f"{method} needs a service identity (a signed token and its certificate)",
                                  reason="service_identity_required")
        audience = policy.audience(method)
        assert self._verifier is not None  # "token" trust has one
        if audience is None:
            raise PermissionDenied(f"{method} is not a mesh method", reason="service_not_allowed")
        return self._verifier.verify(token, cert, audience, method)

    # -- calling side

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if self.trust != "tls" or self.credentials is None:
            return None
        c = self.credentials
        return grpc.ssl_channel_credentials(c.ca_pem, c.key_pem, c.cert_pem)

    def call_metadata(self, method: str | bytes, target_service: str) -> tuple[tuple[str, str], ...]:
        """What a call in "token" trust carries (nothing in the others)."""
        if self._signer is None or self.trust != "token":
            return ()
        name = _text(method)
        token = self._signer.token(policy.audience(name) or target_service, name)
        return ((TOKEN_KEY, token), (CERT_KEY, self._signer.cert_b64))


def cert_b64(pem: bytes) -> str:
    """A PEM certificate as the ``x-llmesh-cert`` value (DER, base64)."""
    return base64.b64encode(x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)).decode()


class _WithToken:
    """Adds a fresh token to every call. grpc.aio files an interceptor under the first
    call kind it implements, so there is one class per kind."""

    def __init__(self, identity: Identity, target_service: str):
        self._identity = identity
        self._target = target_service

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        for key, value in self._identity.call_metadata(details.method, self._target):
            metadata.add(key, value)
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


def client_interceptors(identity: Identity | None, target_service: str) -> list[grpc.aio.ClientInterceptor]:
    if identity is None or identity.trust != "token":
        return []
    return [kind(identity, target_service) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]

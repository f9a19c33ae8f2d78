"""Signed call tokens, for the mesh's "token" trust (plaintext gRPC).

Each call carries ``x-llmesh-token``: ``<payload>.<signature>`` (base64url), the payload
naming the caller (service and instance), the audience (the target service), the method,
an expiry at most ``MAX_TTL_S`` ahead and a random nonce, signed with the key of the
caller's certificate. The certificate itself (DER, base64) rides in ``x-llmesh-cert``;
the server checks it against the mesh CA once and caches it by fingerprint. A server
refuses a token that expired, names another audience or method, or was seen before
(a bounded nonce cache covers the expiry window)."""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

from llmesh.errors import Unauthenticated, Unavailable
from llmesh.rpc.pki import PkiError, Principal, read_principal

TOKEN_KEY = "x-llmesh-token"
CERT_KEY = "x-llmesh-cert"
TOKEN_TTL_S = 20.0
MAX_TTL_S = 30.0
SKEW_S = 5.0  # clocks of two hosts may disagree this much
CERT_CACHE = 1024
NONCE_CACHE = 500_000  # ~16,000 calls/s sustained over a 30 s window

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
PublicKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _refused(message: str) -> Unauthenticated:
    return Unauthenticated(message, reason="invalid_service_token")


def sign(key: PrivateKey, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    return key.sign(data, padding.PKCS1v15(), hashes.SHA256())


def verify_signature(key: PublicKey, signature: bytes, data: bytes) -> None:
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        else:
            key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        raise _refused("the service token's signature does not match its certificate") from None


def load_private_key(pem: bytes) -> PrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        raise PkiError("the service key must be an ECDSA or RSA key")
    return key


class TokenSigner:
    """The calling side: a fresh token per call, and this process's certificate."""

    def __init__(self, principal: Principal, key: PrivateKey, cert_der: bytes,
                 clock: Callable[[], float], ttl_s: float = TOKEN_TTL_S):
        self._principal = principal
        self._key = key
        self.cert_b64 = base64.b64encode(cert_der).decode()
        self._clock = clock
        self._ttl_s = min(ttl_s, MAX_TTL_S)

    def token(self, audience: str, method: str) -> str:
        payload = orjson.dumps({"svc": self._principal.service, "inst": self._principal.instance,
                                "aud": audience, "mth": method, "exp": self._clock() + self._ttl_s,
                                "nonce": secrets.token_urlsafe(16)})
        return f"{_b64(payload)}.{_b64(sign(self._key, payload))}"


@dataclass(frozen=True)
class _Known:
    principal: Principal
    key: PublicKey
    not_after: float


class TokenVerifier:
    """The serving side: who signed a call's token, or Unauthenticated."""

    def __init__(self, ca: x509.Certificate, clock: Callable[[], float],
                 cert_cache: int = CERT_CACHE, nonce_cache: int = NONCE_CACHE):
        self._ca = ca
        self._clock = clock
        self._certs: OrderedDict[bytes, _Known] = OrderedDict()
        self._cert_cache = cert_cache
        self._nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> expiry, about in expiry order
        self._nonce_cache = nonce_cache

    def _certificate(self, cert_b64: str) -> _Known:
        try:
            der = base64.b64decode(cert_b64, validate=True)
        except (binascii.Error, ValueError):
            raise _refused("the caller's certificate is not base64") from None
        fingerprint = hashlib.sha256(der).digest()
        known = self._certs.get(fingerprint)
        if known is None:
            known = self._checked(der)
            self._certs[fingerprint] = known
            if len(self._certs) > self._cert_cache:
                self._certs.popitem(last=False)
        else:
            self._certs.move_to_end(fingerprint)
        if known.not_after < self._clock():
            raise _refused("the caller's certificate has expired")
        return known

    def _checked(self, der: bytes) -> _Known:
        try:
            cert = x509.load_der_x509_certificate(der)
            cert.verify_directly_issued_by(self._ca)
            principal = read_principal(cert)
        except (ValueError, TypeError, InvalidSignature, PkiError) as exc:
            raise _refused(f"the caller's certificate is not one of this mesh's: {exc}") from None
        now = datetime.datetime.fromtimestamp(self._clock(), datetime.timezone.utc)
        if cert.not_valid_before_utc > now:
            raise _refused("the caller's certificate is not valid yet")
        key = cert.public_key()
        if not isinstance(key, (ec.EllipticCurvePublicKey, rsa.RSAPublicKey)):
            raise _refused("the caller's certificate has neither an ECDSA nor an RSA key")
        return _Known(principal, key, cert.not_valid_after_utc.timestamp())

    def verify(self, token: str, cert_b64: str, audience: str, method: str) -> Principal:
        payload_b64, _, signature_b64 = token.partition(".")
        known = self._certificate(cert_b64)
        try:
            payload = _unb64(payload_b64)
            verify_signature(known.key, _unb64(signature_b64), payload)
            claims = orjson.loads(payload)
            service, instance, aud, mth = claims["svc"], claims["inst"], claims["aud"], claims["mth"]
            expiry, nonce = float(claims["exp"]), str(claims["nonce"])
        except (ValueError, TypeError, KeyError, binascii.Error):
            raise _refused("malformed service token") from None
        if (service, instance) != (known.principal.service, known.principal.instance):
            raise _refused("the service token names another caller than its certificate")
        if aud != audience or mth != method:
            raise _refused(f"the service token was issued for {aud} {mth}, not for {method}")
        now = self._clock()
        if expiry < now or expiry > now + MAX_TTL_S + SKEW_S:
            raise Unauthenticated("the service token expired or is not valid yet", reason="expired_service_token")
        self._remember(nonce, expiry, now)
        return known.principal

    def _remember(self, nonce: str, expiry: float, now: float) -> None:
        nonces = self._nonces
        while nonces:
            first, first_expiry = next(iter(nonces.items()))
            if first_expiry >= now - SKEW_S:
                break
            del nonces[first]
        if nonce in nonces:
            raise Unauthenticated("the service token was used before (a replay)", reason="replayed_service_token")
        if len(nonces) >= self._nonce_cache:  # never forget a live nonce: refuse instead
            raise Unavailable("too many service tokens in flight to check for replays; retry shortly")
        nonces[nonce] = expiry

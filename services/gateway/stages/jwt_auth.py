"""JWT bearer tokens -> a Caller: signature (keys from a JWKS file or URL), iss, aud,
exp and nbf; issuer and audience are required settings.

The JWKS is read on the first token, read again when it is older than ``max_age_s``
(key rotation), and when a token names a ``kid`` it lacks, but never more than once
per ``refetch_s``: a storm of tokens with made-up ``kid``s costs the identity
provider one fetch per interval, and is otherwise answered from the keys held (stale
by at most ``refetch_s`` for a new key, ``max_age_s`` for a removed one). While the
JWKS cannot be read, the last keys read stay in use."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import jwt

from llmesh.errors import Unauthenticated
from llmesh.gateway.context import Caller

log = logging.getLogger("llmesh.gateway.auth")

ALGORITHMS = ["RS256", "RS384", "RS512", "ES256", "ES384", "PS256", "EdDSA"]
Keys = dict[str | None, jwt.PyJWK]


@dataclass(frozen=True, slots=True)
class JwtSettings:
    jwks_file: Path | None = None
    jwks_url: str | None = None
    issuer: str | None = None
    audience: str | None = None
    tenant_claim: str = "tenant"
    groups_claim: str = "groups"
    leeway_s: float = 0.0
    refetch_s: float = 30.0  # an unknown kid reads the JWKS again at most this often
    max_age_s: float = 300.0  # keys older than this are read again (at most once per refetch_s)


def _parse(raw: str | bytes) -> Keys:
    return {k.key_id: k for k in jwt.PyJWKSet.from_json(raw if isinstance(raw, str) else raw.decode()).keys}


def jwks_reader(settings: JwtSettings) -> Callable[[], Awaitable[Keys]]:
    """Reads the configured JWKS (file or URL) off the event loop."""
    if settings.jwks_url:
        client = jwt.PyJWKClient(settings.jwks_url, cache_jwk_set=False, timeout=10)

        async def from_url() -> Keys:
            data = await asyncio.to_thread(client.fetch_data)
            return _parse(json.dumps(data))
        return from_url
    path = settings.jwks_file
    if path is None:
        raise ValueError("a JWKS file or URL is needed")

    async def from_file() -> Keys:
        return _parse(await asyncio.to_thread(path.read_text))
    return from_file


class JwksKeys:
    """The signing keys by kid, read through ``read`` at most once per ``refetch_s``."""

    def __init__(self, read: Callable[[], Awaitable[Keys]], refetch_s: float, max_age_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._read = read
        self._refetch_s = refetch_s
        self._max_age_s = max_age_s
        self._clock = clock
        self._keys: Keys | None = None
        self._read_at = float("-inf")  # last successful read
        self._tried_at = float("-inf")  # last attempt, successful or not
        self._lock = asyncio.Lock()
        self.reads = 0  # attempts, for tests and metrics

    async def key(self, kid: str | None) -> jwt.PyJWK:
        now = self._clock()
        stale = self._keys is None or now - self._read_at > self._max_age_s or self._find(kid) is None
        if stale and now - self._tried_at >= self._refetch_s:
            await self._refresh(self._tried_at)
        key = self._find(kid)
        if key is None:
            if self._keys is None:
                raise jwt.InvalidTokenError("the JWKS cannot be read right now")
            raise jwt.InvalidTokenError(f"no key '{kid}' in the JWKS")
        return key

    def _find(self, kid: str | None) -> jwt.PyJWK | None:
        keys = self._keys or {}
        key = keys.get(kid)
        if key is None and kid is None and len(keys) == 1:
            key = next(iter(keys.values()))
        return key

    async def _refresh(self, seen: float) -> None:
        async with self._lock:  # one read at a time; who waited for it uses its answer
            if self._tried_at != seen:
                return
            self._tried_at = self._clock()
            self.reads += 1
            try:
                self._keys = await self._read()
                self._read_at = self._clock()
            except (OSError, ValueError, jwt.PyJWTError) as exc:
                log.warning("cannot read the JWKS; the last keys read stay in use",
                            extra={"error": str(exc), "have_keys": self._keys is not None})


class JwtVerifier:
    """Signature, iss, aud, exp and nbf; a token must carry the tenant claim."""

    def __init__(self, settings: JwtSettings, clock: Callable[[], float] = time.monotonic):
        if not (settings.jwks_file or settings.jwks_url):
            raise ValueError("a JWKS file or URL is needed")
        if not (settings.issuer and settings.audience):
            raise ValueError("JWT needs an issuer and an audience to check: set LLMESH_GATEWAY_JWT_ISSUER and "
                             "LLMESH_GATEWAY_JWT_AUDIENCE")
        self._s = settings
        self.keys = JwksKeys(jwks_reader(settings), settings.refetch_s, settings.max_age_s, clock)

    async def verify(self, token: str) -> Caller:
        try:
            key = await self.keys.key(jwt.get_unverified_header(token).get("kid"))
            claims = jwt.decode(token, key, algorithms=ALGORITHMS, audience=self._s.audience,
                                issuer=self._s.issuer, leeway=self._s.leeway_s,
                                options={"require": ["exp", "iss", "aud"]})
        except jwt.ExpiredSignatureError:
            raise Unauthenticated("The bearer token has expired.", reason="token_expired") from None
        except (jwt.PyJWTError, ValueError) as exc:
            raise Unauthenticated(f"The bearer token is not valid: {exc}.", reason="invalid_token") from None
        tenant = claims.get(self._s.tenant_claim)
        if not isinstance(tenant, str) or not tenant:
            raise Unauthenticated(f"The bearer token has no '{self._s.tenant_claim}' claim.",
                                  reason="invalid_token")
        groups = claims.get(self._s.groups_claim) or ()
        if isinstance(groups, str):
            groups = (groups,)
        return Caller(tenant=tenant, subject=str(claims.get("sub", "")), method="jwt",
                      groups=tuple(str(g) for g in groups))

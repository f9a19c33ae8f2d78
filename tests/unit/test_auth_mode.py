"""Gateway authentication never opens by itself: local mode is decided at start from
settings (loopback listeners, no Redis, no JWT, require_auth unset), never from the
key store; an emptied store answers 401; unknown tenants are denied; JWT needs iss and
aud; an unknown kid reads the JWKS at most once per interval; replicas share a store."""

from __future__ import annotations

import json
import logging

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from pydantic import ValidationError

from llmesh.discovery.base import Instance
from llmesh.errors import DiscoveryError, PermissionDenied, Unauthenticated
from llmesh.keys import FileKeyStore, new_key
from llmesh.liveconfig.schema import MeshConfig
from llmesh.service import StartFailed
from llmesh.gateway.app import _auth_mode, _check_shared_store
from llmesh.gateway.config import GatewaySettings
from llmesh.gateway.context import Caller
from llmesh.gateway.domain.auth_mode import auth_mode, shared_store_problem
from llmesh.gateway.stages.auth import EMPTY_STORE_LOG_S, Authenticator
from llmesh.gateway.stages.grants import access
from llmesh.gateway.stages.jwt_auth import JwksKeys, JwtSettings, JwtVerifier

LOOPBACK = {"http_host": "127.0.0.1", "grpc_host": "127.0.0.1", "redis": False, "jwt": False,
            "require_auth": False}


def test_local_mode_only_when_every_condition_holds():
    assert auth_mode(**LOOPBACK).local
    for change, words in [({"http_host": "0.0.0.0"}, "HTTP listener binds 0.0.0.0"),
                          ({"grpc_host": "::"}, "gRPC listener binds ::"),
                          ({"redis": True}, "LLMESH_REDIS_URL"), ({"jwt": True}, "JWKS"),
                          ({"require_auth": True}, "REQUIRE_AUTH")]:
        mode = auth_mode(**{**LOOPBACK, **change})
        assert not mode.local and words in mode.describe(), change


def test_the_gateways_settings_decide_it():
    assert _auth_mode(GatewaySettings(), None).local
    assert not _auth_mode(GatewaySettings(http_host="0.0.0.0"), None).local
    assert not _auth_mode(GatewaySettings(host="0.0.0.0"), None).local
    assert not _auth_mode(GatewaySettings(), "redis://127.0.0.1:6379/0").local
    assert not _auth_mode(GatewaySettings(require_auth=True), None).local
    assert not _auth_mode(GatewaySettings(jwks_url="https://idp/jwks", jwt_issuer="i", jwt_audience="a"), None).local


@pytest.mark.parametrize("missing", ["jwt_issuer", "jwt_audience"])
def test_jwt_without_issuer_or_audience_is_a_settings_error(tmp_path, missing):
    full = {"jwks_file": tmp_path / "jwks.json", "jwt_issuer": "https://idp", "jwt_audience": "llmesh"}
    GatewaySettings(**full)
    with pytest.raises(ValidationError, match="LLMESH_GATEWAY_JWT_ISSUER and LLMESH_GATEWAY_JWT_AUDIENCE"):
        GatewaySettings(**{k: v for k, v in full.items() if k != missing})
    checks = {"issuer": "https://idp", "audience": "llmesh"}
    del checks[missing.removeprefix("jwt_")]
    with pytest.raises(ValueError, match="issuer and an audience"):
        JwtVerifier(JwtSettings(jwks_file=tmp_path / "jwks.json", **checks))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_required_mode_refuses_while_the_store_is_empty_and_says_why_once(tmp_path, caplog):
    clock = Clock()
    store = FileKeyStore(tmp_path / "keys.json")
    auth = Authenticator(store, cache_s=0, clock=clock)  # not local: listeners off loopback, Redis, ...
    caplog.set_level(logging.WARNING, "llmesh.gateway.auth")
    for credential in (None, "sk-anything", "llm_abc_def", "x" * 200):
        with pytest.raises(Unauthenticated):
            await auth.authenticate(credential)
    said = [r for r in caplog.records if "holds no keys" in r.getMessage()]
    assert len(said) == 1 and "sk-anything" not in caplog.text and "llm_abc_def" not in caplog.text
    clock.now += EMPTY_STORE_LOG_S
    with pytest.raises(Unauthenticated):
        await auth.authenticate(None)
    assert len([r for r in caplog.records if "holds no keys" in r.getMessage()]) == 2


async def test_an_emptied_store_does_not_open_the_door(tmp_path, caplog):
    store = FileKeyStore(tmp_path / "keys.json")
    plaintext, record = new_key("acme")
    await store.put(record)
    auth = Authenticator(store, cache_s=0)
    assert (await auth.authenticate(plaintext)).tenant == "acme"
    (tmp_path / "keys.json").unlink()  # FLUSHALL, eviction, a fresh replica's own store
    for credential in (None, "sk-anything", plaintext):
        with pytest.raises(Unauthenticated):
            await auth.authenticate(credential)


async def test_in_local_mode_a_real_key_is_never_refused_while_garbage_passes(tmp_path):
    store = FileKeyStore(tmp_path / "keys.json")
    auth = Authenticator(store, cache_s=0, local=True)
    foreign, _ = new_key("acme")  # a real key's shape, from a store this gateway does not read
    assert (await auth.authenticate("garbage")).tenant == "default"
    assert (await auth.authenticate(foreign)).tenant == "default"
    plaintext, record = new_key("acme")
    await store.put(record)  # the first key ends local mode; the key is its tenant
    assert (await auth.authenticate(plaintext)).tenant == "acme"
    for credential in ("garbage", foreign, None):
        with pytest.raises(Unauthenticated):
            await auth.authenticate(credential)


def test_unknown_tenants_are_denied_unless_a_wildcard_grants_them():
    config = MeshConfig.model_validate({"tenants": {"acme": {"models": ["small"]}}})
    for method in ("api_key", "jwt"):
        with pytest.raises(PermissionDenied) as info:
            access(config, Caller(tenant="stranger", subject="k", method=method))
        assert info.value.reason == "unknown_tenant"
        with pytest.raises(PermissionDenied):
            access(MeshConfig(), Caller(tenant="default", subject="k", method=method))  # no config: no grant
    assert access(config, Caller(tenant="acme", method="api_key")).allows("small")
    wildcard = MeshConfig.model_validate({"tenants": {"*": {"models": ["small"]}}})
    assert access(wildcard, Caller(tenant="stranger", method="jwt")).allows("small")
    assert access(MeshConfig(), Caller()).models is None  # local mode's caller: the open grant


def _jwks(*kids: str) -> dict:
    keys = []
    for kid in kids:
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(
            rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()))
        public.update(kid=kid, alg="RS256")
        keys.append(public)
    return {"keys": keys}


async def test_an_unknown_kid_storm_reads_the_jwks_at_most_once_per_interval():
    clock = Clock()
    served = {"jwks": _jwks("k1")}

    async def read():
        return {k.key_id: k for k in jwt.PyJWKSet.from_dict(served["jwks"]).keys}

    keys = JwksKeys(read, refetch_s=30, max_age_s=300, clock=clock)
    assert (await keys.key("k1")).key_id == "k1" and keys.reads == 1
    for i in range(200):
        with pytest.raises(jwt.InvalidTokenError, match="no key"):
            await keys.key(f"made-up-{i}")
        clock.now += 0.1  # 20 s in all: inside one interval, which began with the first read
    assert keys.reads == 1
    served["jwks"] = _jwks("k1", "k2")  # rotation: a new key
    clock.now += 10
    assert (await keys.key("k2")).key_id == "k2" and keys.reads == 2
    for i in range(100):
        with pytest.raises(jwt.InvalidTokenError):
            await keys.key(f"again-{i}")
    assert keys.reads == 2


async def test_a_jwks_that_cannot_be_read_keeps_the_last_keys():
    clock = Clock()
    state = {"fail": False}

    async def read():
        if state["fail"]:
            raise OSError("idp down")
        return {k.key_id: k for k in jwt.PyJWKSet.from_dict(_jwks("k1")).keys}

    keys = JwksKeys(read, refetch_s=30, max_age_s=300, clock=clock)
    await keys.key("k1")
    state["fail"] = True
    clock.now += 301  # too old: read again, which fails
    assert (await keys.key("k1")).key_id == "k1" and keys.reads == 2
    with pytest.raises(jwt.InvalidTokenError):
        await keys.key("k9")
    assert keys.reads == 2  # the failed read counts for the interval too


def test_replicas_without_a_shared_store_are_a_problem():
    assert shared_store_problem(0, redis=False) is None
    assert shared_store_problem(2, redis=True) is None
    assert "LLMESH_REDIS_URL" in (shared_store_problem(1, redis=False) or "")


class Registry:
    def __init__(self, instances=(), error: Exception | None = None):
        self._instances, self._error = list(instances), error

    async def resolve(self, service: str):
        if self._error:
            raise self._error
        return [i for i in self._instances if i.service == service]


async def test_a_second_gateway_without_redis_refuses_to_start():
    other = Instance("gateway", "gateway-a-1", "10.0.0.1:50051")
    with pytest.raises(StartFailed, match="LLMESH_REDIS_URL"):
        await _check_shared_store(Registry([other]), redis=False)
    await _check_shared_store(Registry([other]), redis=True)
    await _check_shared_store(Registry([Instance("engine", "e", "10.0.0.2:1")]), redis=False)
    await _check_shared_store(Registry(error=DiscoveryError("away")), redis=False)  # cannot tell: starts

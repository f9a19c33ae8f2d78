"""API keys and JWT bearer tokens -> callers; local mode until credentials exist."""

from __future__ import annotations

import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from llmesh.errors import Unauthenticated
from llmesh.keys import FileKeyStore, new_key, revoke, rotate, split_key
from llmesh.gateway.stages.auth import Authenticator, JwtSettings, JwtVerifier


def rsa_key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def signer():
    return rsa_key()


@pytest.fixture()
def jwks(tmp_path, signer):
    public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(signer.public_key()))
    public.update(kid="k1", use="sig", alg="RS256")
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [public]}))
    return path


def token(key, **claims) -> str:
    now = time.time()
    body = {"iss": "https://idp.example", "aud": "llmesh", "sub": "alice", "tenant": "acme",
            "groups": ["eng"], "iat": now, "exp": now + 300, **claims}
    return jwt.encode({k: v for k, v in body.items() if v is not None}, key, algorithm="RS256",
                      headers={"kid": "k1"})


def verifier(jwks) -> JwtVerifier:
    return JwtVerifier(JwtSettings(jwks_file=jwks, issuer="https://idp.example", audience="llmesh"))


async def test_valid_jwt_maps_claims_to_tenant_and_groups(jwks, signer):
    caller = await Authenticator(None, verifier(jwks)).authenticate(token(signer))
    assert (caller.tenant, caller.subject, caller.method, caller.groups) == ("acme", "alice", "jwt", ("eng",))


@pytest.mark.parametrize("case, reason", [
    ("expired", "token_expired"), ("wrong_audience", "invalid_token"), ("wrong_issuer", "invalid_token"),
    ("wrong_signature", "invalid_token"), ("not_yet_valid", "invalid_token"), ("no_tenant", "invalid_token"),
    ("garbage", "invalid_token"), ("no_exp", "invalid_token")])
async def test_bad_jwts_are_refused(jwks, signer, case, reason):
    now = time.time()
    bad = {
        "expired": lambda: token(signer, exp=now - 10, iat=now - 100),
        "wrong_audience": lambda: token(signer, aud="someone-else"),
        "wrong_issuer": lambda: token(signer, iss="https://evil.example"),
        "wrong_signature": lambda: token(rsa_key()),
        "not_yet_valid": lambda: token(signer, nbf=now + 600),
        "no_tenant": lambda: token(signer, tenant=None),
        "garbage": lambda: "abc.def.ghi",
        "no_exp": lambda: token(signer, exp=None),
    }[case]()
    with pytest.raises(Unauthenticated) as info:
        await Authenticator(None, verifier(jwks)).authenticate(bad)
    assert info.value.reason == reason


async def test_local_mode_until_a_key_exists(tmp_path):
    store = FileKeyStore(tmp_path / "keys.json")
    auth = Authenticator(store, cache_s=0, local=True)
    assert (await auth.authenticate(None)).tenant == "default"
    assert (await auth.authenticate("sk-anything")).tenant == "default"  # the SDK always sends one
    plaintext, record = new_key("acme", models=("m1",))
    await store.put(record)
    with pytest.raises(Unauthenticated):
        await auth.authenticate(None)
    with pytest.raises(Unauthenticated):
        await auth.authenticate("sk-anything")
    caller = await auth.authenticate(plaintext)
    assert (caller.tenant, caller.subject, caller.models) == ("acme", record.key_id, ("m1",))


async def test_keys_are_stored_hashed_and_checked_exactly(tmp_path):
    store = FileKeyStore(tmp_path / "keys.json")
    plaintext, record = new_key("acme")
    await store.put(record)
    key_id, secret = split_key(plaintext)
    assert secret not in (tmp_path / "keys.json").read_text()
    auth = Authenticator(store, cache_s=0)
    with pytest.raises(Unauthenticated):
        await auth.authenticate(f"llm_{key_id}_{secret[:-1]}x")
    with pytest.raises(Unauthenticated):
        await auth.authenticate(f"llm_nosuchid_{secret}")


async def test_revoked_rotated_and_expired_keys(tmp_path):
    store = FileKeyStore(tmp_path / "keys.json")
    auth = Authenticator(store, cache_s=0)
    old_plain, old = new_key("acme")
    await store.put(old)
    new_plain, _ = await rotate(store, old.key_id)
    with pytest.raises(Unauthenticated) as info:
        await auth.authenticate(old_plain)
    assert info.value.reason == "key_revoked"
    assert (await auth.authenticate(new_plain)).tenant == "acme"
    gone_plain, gone = new_key("acme", expires_at=time.time() - 1)
    await store.put(gone)
    with pytest.raises(Unauthenticated) as info:
        await auth.authenticate(gone_plain)
    assert info.value.reason == "key_expired"
    await revoke(store, (await auth.authenticate(new_plain)).subject)
    with pytest.raises(Unauthenticated):
        await auth.authenticate(new_plain)

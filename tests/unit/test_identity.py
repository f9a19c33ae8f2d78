"""Signed call tokens and the loopback rule of local trust, without a server."""

import pytest

from llmesh.errors import Unauthenticated, Unavailable
from llmesh.rpc.identity import CERT_KEY, TOKEN_KEY, Credentials, Identity, IdentityError
from llmesh.rpc.pki import Principal, ensure_pki
from llmesh.rpc.tokens import MAX_TTL_S, TokenVerifier

UNLOAD = "/llmesh.v1.Engine/UnloadModel"


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    files = ensure_pki(d, [("modelmgr", "modelmgr-0"), ("engine", "engine-0")])
    return {k: Credentials.load(f.ca_file, f.cert_file, f.key_file) for k, f in files.items()}


@pytest.fixture(scope="module")
def now(creds):
    """A fixed clock inside the certificates' validity (made now, valid from 5 minutes back): not the
    time the module was imported, which a long test run leaves before the certificates' start."""
    from cryptography import x509
    cert = x509.load_pem_x509_certificate(creds["modelmgr-0"].cert_pem)
    return float(int(cert.not_valid_before_utc.timestamp())) + 300


def _verifier(creds, now, nonces=100):
    from cryptography import x509
    return TokenVerifier(x509.load_pem_x509_certificate(creds["engine-0"].ca_pem), lambda: now, nonce_cache=nonces)


def _call(creds, now, method=UNLOAD, audience="engine"):
    md = dict(Identity("modelmgr", "token", creds["modelmgr-0"], clock=lambda: now).call_metadata(method, audience))
    return md[TOKEN_KEY], md[CERT_KEY]


def test_a_token_names_its_caller_once(creds, now):
    verifier = _verifier(creds, now)
    token, cert = _call(creds, now)
    assert verifier.verify(token, cert, "engine", UNLOAD) == Principal("modelmgr", "modelmgr-0")
    with pytest.raises(Unauthenticated, match="replay"):
        verifier.verify(token, cert, "engine", UNLOAD)


@pytest.mark.parametrize("minted_after", [-100, MAX_TTL_S])
def test_an_expired_or_far_future_token_is_refused(creds, now, minted_after):
    token, cert = _call(creds, now + minted_after)
    with pytest.raises(Unauthenticated, match="expired"):
        _verifier(creds, now).verify(token, cert, "engine", UNLOAD)


@pytest.mark.parametrize("audience,method", [("scheduler", UNLOAD), ("engine", "/llmesh.v1.Engine/LoadModel")])
def test_a_token_for_another_audience_or_method_is_refused(creds, now, audience, method):
    token, cert = _call(creds, now)
    with pytest.raises(Unauthenticated, match="issued for"):
        _verifier(creds, now).verify(token, cert, audience, method)


@pytest.mark.parametrize("mangle", [lambda t: t[:-4] + "AAAA", lambda t: "x" + t, lambda t: "garbage", lambda t: ""])
def test_a_tampered_token_is_refused(creds, now, mangle):
    token, cert = _call(creds, now)
    with pytest.raises(Unauthenticated):
        _verifier(creds, now).verify(mangle(token), cert, "engine", UNLOAD)


def test_the_nonce_cache_forgets_only_expired_nonces_and_refuses_when_full(creds, now):
    verifier = _verifier(creds, now, nonces=2)
    for _ in range(2):
        verifier.verify(*_call(creds, now), "engine", UNLOAD)
    with pytest.raises(Unavailable):  # full of live nonces: never forget one, refuse instead
        verifier.verify(*_call(creds, now), "engine", UNLOAD)
    later = _verifier(creds, now, nonces=2)
    later._clock = lambda: now + MAX_TTL_S + 10  # the first two expired
    later._nonces.update(verifier._nonces)
    later.verify(*_call(creds, now + MAX_TTL_S + 10), "engine", UNLOAD)


@pytest.mark.parametrize("address,ok", [("127.0.0.1:1", True), ("localhost:1", True), ("[::1]:1", True),
                                        ("0.0.0.0:1", False), ("10.0.0.5:1", False), ("[::]:1", False)])
def test_local_trust_listens_on_loopback_only(creds, address, ok):
    if ok:
        Identity("engine").check_bind(address)
    else:
        with pytest.raises(IdentityError, match="loopback"):
            Identity("engine").check_bind(address)
    Identity("engine", "token", creds["engine-0"]).check_bind(address)  # identities make any address fine
    Identity("engine", "tls", creds["engine-0"]).check_bind(address)


def test_local_trust_adds_nothing_to_calls(creds):
    assert Identity("engine").call_metadata(UNLOAD, "engine") == ()
    assert Identity("engine", "tls", creds["engine-0"]).call_metadata(UNLOAD, "engine") == ()

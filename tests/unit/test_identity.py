"""Service tokens and who may call the admin RPCs."""

import pytest

from llmesh.errors import PermissionDenied, Unauthenticated
from llmesh.rpc.identity import TOKEN_KEY, Identity, IdentityError, mint, read_secret, verify

SECRET = b"s" * 32
UNLOAD = "/llmesh.v1.Engine/UnloadModel"


def test_a_minted_token_verifies_and_names_its_service():
    assert verify(SECRET, mint(SECRET, "modelmgr", now=1000), now=1030) == "modelmgr"


@pytest.mark.parametrize("token", [
    mint(b"x" * 32, "modelmgr", now=1000),                       # another secret
    mint(SECRET, "modelmgr", now=1000).replace("modelmgr", "gateway"),  # claim changed after signing
    mint(SECRET, "modelmgr", now=900),                           # expired at 960
    mint(SECRET, "modelmgr", now=1000, ttl_s=3600),              # valid too far ahead
    "v1.modelmgr.nope.abc", "garbage", ""])
def test_bad_tokens_are_refused(token):
    with pytest.raises(Unauthenticated):
        verify(SECRET, token, now=1000)


def test_with_a_secret_admin_methods_need_a_valid_token_and_others_do_not():
    server = Identity("engine", SECRET, clock=lambda: 1000.0)
    server.authorize("/llmesh.v1.Engine/Generate", ())
    with pytest.raises(Unauthenticated):
        server.authorize(UNLOAD, ())
    with pytest.raises(Unauthenticated):
        server.authorize(UNLOAD, [(TOKEN_KEY, mint(b"y" * 32, "rogue", 1000))])
    server.authorize(UNLOAD, [(TOKEN_KEY, Identity("modelmgr", SECRET, clock=lambda: 1000.0).token())])


def test_without_a_secret_admin_methods_are_open_only_in_local_trust():
    with pytest.raises(PermissionDenied):
        Identity("engine").authorize("/llmesh.v1.Scheduler/Report", ())
    Identity("engine", local_trust=True).authorize("/llmesh.v1.Scheduler/Report", ())
    assert Identity("engine").token() is None


@pytest.mark.parametrize("address,ok", [("127.0.0.1:1", True), ("localhost:1", True), ("[::1]:1", True),
                                        ("0.0.0.0:1", False), ("10.0.0.5:1", False), ("[::]:1", False)])
def test_local_trust_listens_on_loopback_only(address, ok):
    if ok:
        Identity("engine", local_trust=True).check_bind(address)
    else:
        with pytest.raises(IdentityError, match="loopback"):
            Identity("engine", local_trust=True).check_bind(address)
    Identity("engine", SECRET).check_bind(address)  # a secret makes any address fine


def test_a_short_secret_is_refused(tmp_path):
    (tmp_path / "s").write_text("short\n")
    with pytest.raises(IdentityError, match="at least 32"):
        read_secret(tmp_path / "s")
    (tmp_path / "s").write_text("a" * 64 + "\n")
    assert read_secret(tmp_path / "s") == b"a" * 64

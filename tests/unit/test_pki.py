"""The mesh's certificates: made once, reused, each naming its service and instance."""

import stat

import pytest
from cryptography import x509

from llmesh.rpc.pki import PkiError, Principal, ensure_pki, issue, read_principal


def test_a_certificate_names_its_service_and_instance(tmp_path):
    files = ensure_pki(tmp_path, [("engine", "engine-0"), ("gateway", "gateway")])
    assert read_principal(files["engine-0"].cert_file.read_bytes()) == Principal("engine", "engine-0")
    shared = read_principal(files["gateway"].cert_file.read_bytes())
    assert shared == Principal("gateway", "gateway") and shared.shared
    cert = x509.load_pem_x509_certificate(files["engine-0"].cert_file.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["engine.llmesh.internal"]
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    assert read_principal(cert.public_bytes(__import__("cryptography").hazmat.primitives.serialization
                                            .Encoding.DER)) == Principal("engine", "engine-0")


def test_keys_are_private_to_their_owner(tmp_path):
    ensure_pki(tmp_path, [("cache", "cache-0")])
    for name in ("ca-key.pem", "cache-0-key.pem"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600


def test_what_exists_is_reused_and_only_missing_identities_are_made(tmp_path):
    ensure_pki(tmp_path, [("engine", "engine-0")])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    ensure_pki(tmp_path, [("engine", "engine-0"), ("engine", "engine-1")])
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert {k: after[k] for k in before} == before
    assert {"engine-1.pem", "engine-1-key.pem"} <= after.keys()
    ca = x509.load_pem_x509_certificate(after["ca.pem"])
    x509.load_pem_x509_certificate(after["engine-1.pem"]).verify_directly_issued_by(ca)


def test_an_existing_certificate_for_another_service_is_an_error(tmp_path):
    ensure_pki(tmp_path, [("engine", "x")])
    with pytest.raises(PkiError, match="another service"):
        ensure_pki(tmp_path, [("gateway", "x")])


def test_unknown_services_and_foreign_certificates_are_refused(tmp_path):
    ensure_pki(tmp_path, [("cli", "cli")])
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    with pytest.raises(PkiError, match="unknown mesh service"):
        issue(ca, None, "rogue", "r")  # type: ignore[arg-type]
    with pytest.raises(PkiError, match="subject alternative name"):
        read_principal(ca)

"""The mesh's certificates: one CA and a certificate per service instance.

A certificate names its holder twice: the DNS SAN ``<service>.llmesh.internal`` (the
service, what the per-method policy checks; clients verify a server against it) and
the subject CN (the instance, e.g. ``engine-0``, or the service name itself when one
certificate is shared by all replicas). ``ensure_pki`` makes what a one-machine mesh
needs (``llmesh up --secure``) and reuses what is already there."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DOMAIN = "llmesh.internal"
SERVICES = frozenset({"gateway", "engine", "scheduler", "modelmgr", "cache", "cli"})
CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"
CA_DAYS = 3650
LEAF_DAYS = 825


class PkiError(ValueError):
    pass


@dataclass(frozen=True)
class Principal:
    """Who a certificate speaks for: the service (its SAN) and the instance (its CN)."""
    service: str
    instance: str

    @property
    def shared(self) -> bool:
        """One certificate for every replica (CN == the service name), so no instance is known."""
        return self.instance == self.service


def service_dns(service: str) -> str:
    return f"{service}.{DOMAIN}"


def read_principal(cert: x509.Certificate | bytes) -> Principal:
    """The principal a certificate (an object, or PEM/DER bytes) names; PkiError when it names
    no mesh service (no ``<service>.llmesh.internal`` SAN, or more than one)."""
    if isinstance(cert, bytes):
        cert = (x509.load_pem_x509_certificate(cert) if cert.lstrip().startswith(b"-----")
                else x509.load_der_x509_certificate(cert))
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise PkiError("the certificate has no subject alternative name") from None
    suffix = "." + DOMAIN
    services = {n[: -len(suffix)] for n in names.get_values_for_type(x509.DNSName) if n.endswith(suffix)}
    if len(services) != 1:
        raise PkiError(f"the certificate must name exactly one *.{DOMAIN} service, it names {sorted(services)}")
    service = services.pop()
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    instance = str(cns[0].value) if cns else service
    return Principal(service, instance)


def _write_private(path: Path, data: bytes) -> None:
    """A key file readable by its owner only, from the moment it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    path.chmod(0o600)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _builder(subject: str, issuer: x509.Name, public: ec.EllipticCurvePublicKey, days: int,
             now: datetime.datetime) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer).public_key(public).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
    key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{directory / CA_KEY} is not an ECDSA key")
    return cert, key


def _make_ca(directory: Path, now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmesh mesh CA")])
    cert = (_builder("llmesh mesh CA", name, key.public_key(), CA_DAYS, now)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_private(directory / CA_KEY, _pem_key(key))
    (directory / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def issue(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, service: str, instance: str,
          days: int = LEAF_DAYS) -> tuple[bytes, bytes]:
    """A new certificate and key (PEM) for ``instance`` of ``service``, signed by the CA."""
    if service not in SERVICES:
        raise PkiError(f"unknown mesh service {service!r}; one of {sorted(SERVICES)}")
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(instance, ca_cert.subject, key.public_key(), days, now)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(service_dns(service))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


@dataclass(frozen=True)
class IdentityFiles:
    ca_file: Path
    cert_file: Path
    key_file: Path


def identity_files(directory: Path, instance: str) -> IdentityFiles:
    return IdentityFiles(directory / CA_CERT, directory / f"{instance}.pem", directory / f"{instance}-key.pem")


def ensure_pki(directory: Path, identities: Iterable[tuple[str, str]]) -> dict[str, IdentityFiles]:
    """The mesh CA (made once) and a certificate + key per ``(service, instance)`` that lacks
    one, under ``directory``; what exists is reused, never regenerated. Returns each
    instance's files (the values of LLMESH_TLS_CA_FILE / _CERT_FILE / _KEY_FILE)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    if (directory / CA_CERT).exists() and (directory / CA_KEY).exists():
        ca_cert, ca_key = _load_ca(directory)
    else:
        ca_cert, ca_key = _make_ca(directory, now)
    out: dict[str, IdentityFiles] = {}
    for service, instance in identities:
        files = identity_files(directory, instance)
        if not (files.cert_file.exists() and files.key_file.exists()):
            cert_pem, key_pem = issue(ca_cert, ca_key, service, instance)
            _write_private(files.key_file, key_pem)
            files.cert_file.write_bytes(cert_pem)
        elif read_principal(files.cert_file.read_bytes()).service != service:
            raise PkiError(f"{files.cert_file} exists for another service than {service}")
        out[instance] = files
    return out

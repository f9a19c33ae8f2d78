"""Production trust on one machine: ``llmesh up --secure`` (mutual TLS) and
``llmesh up --secure --trust token`` (signed per-call tokens), one sim mesh each.

For every internal method of llmesh.rpc.policy's table: a call without identity is
refused, a call with the certificate of a service the method does not allow gets
PERMISSION_DENIED, and the allowed caller's certificate gets past the identity check
(the empty request may still fail for its own reasons). The official openai client is
served with an API key made by ``llmesh keys create``, and refused without one; the CLI
verbs find the cli certificate of the running mesh by themselves. Token mode: a replayed
token and a token for another method or service are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
from cryptography import x509
from cryptography.hazmat.primitives import serialization
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from openai import OpenAI

from llmesh.rpc import policy
from llmesh.rpc.pki import ensure_pki, identity_files, read_principal
from llmesh.rpc.tokens import CERT_KEY, TOKEN_KEY, TokenSigner, load_private_key
from llmesh.testing import Mesh, free_layout
from llmesh.v1 import cache_pb2, engine_pb2, gateway_pb2, modelmgr_pb2, scheduler_pb2

SIM = "sim-small"
TENANT = "acme"
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE)
ENGINE_PROBE = "engine-9"  # a certificate of the mesh's CA for an engine that reports itself (not engine-0)
MODULES = (cache_pb2, engine_pb2, gateway_pb2, modelmgr_pb2, scheduler_pb2)


def _descriptor(path: str) -> MethodDescriptor:
    service, method = path.strip("/").split("/")
    for module in MODULES:
        for svc in module.DESCRIPTOR.services_by_name.values():
            if svc.full_name == service:
                return svc.methods_by_name[method]
    raise LookupError(path)


METHODS = sorted(policy.ALLOWED)
CALLERS = ("gateway", "engine", "scheduler", "modelmgr", "cache", "cli")


def _disallowed(path: str) -> str | None:
    return next((s for s in CALLERS if s not in policy.allowed_callers(path)), None)


def _instance(service: str) -> str:
    return {"engine": "engine-0"}.get(service, service)


def _start(tmp: Path, trust: str) -> Iterator[Mesh]:
    config = tmp / "llmesh.yaml"
    config.write_text(json.dumps({"default": {"max_attempts": 2}, "tenants": {TENANT: {"models": [SIM]}}}))
    mesh = Mesh(layout=free_layout(n_engines=1), engines="sim", model_dir=tmp / "models", log_dir=tmp / "logs",
                args=["--secure", "--trust", trust], env={"LLMESH_CONFIG_FILE": str(config)})
    mesh.start(timeout_s=90)
    mesh.pki = tmp / "logs" / "state" / "pki"  # Mesh's LLMESH_STATE_DIR is <log_dir>/state
    ensure_pki(mesh.pki, [("engine", ENGINE_PROBE)])
    try:
        yield mesh
    finally:
        assert mesh.stop() == 0, mesh.logs()


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory) -> Iterator[Mesh]:
    yield from _start(tmp_path_factory.mktemp("secure-tls"), "tls")


@pytest.fixture(scope="module")
def token_mesh(tmp_path_factory) -> Iterator[Mesh]:
    yield from _start(tmp_path_factory.mktemp("secure-token"), "token")


def _target(path: str) -> str:
    target = policy.audience(path)
    assert target is not None, path
    return target


def _address(mesh: Mesh, path: str) -> str:
    target = _target(path)
    return mesh.layout.engine_address(0) if target == "engine" else mesh.layout.address(target)


def _tls_channel(mesh: Mesh, path: str, instance: str | None) -> grpc.Channel:
    """A channel to ``path``'s service over the mesh's TLS, with ``instance``'s certificate (None: none)."""
    files = identity_files(mesh.pki, instance or "cli")
    creds = grpc.ssl_channel_credentials(
        files.ca_file.read_bytes(), *((files.key_file.read_bytes(), files.cert_file.read_bytes()) if instance
                                      else (None, None)))
    return grpc.secure_channel(_address(mesh, path), creds,
                               options=[("grpc.ssl_target_name_override", f"{_target(path)}.llmesh.internal")])


def _request(path: str, caller: str | None):
    d = _descriptor(path)
    message = message_factory.GetMessageClass(d.input_type)()
    if path.endswith("Scheduler/Report") and caller == ENGINE_PROBE:
        message.endpoint_id, message.address, message.backend = ENGINE_PROBE, "127.0.0.1:1", "sim"
    return message


def _call(channel: grpc.Channel, path: str, request, metadata=()) -> grpc.StatusCode:
    """The status of one call of ``path`` with ``request`` (a server stream: its first message or end)."""
    d = _descriptor(path)
    out_cls = message_factory.GetMessageClass(d.output_type)
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
        (d.client_streaming, d.server_streaming)]
    rpc = kind(path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=out_cls.FromString)
    arg = iter([request]) if d.client_streaming else request
    try:
        answer = rpc(arg, timeout=5, metadata=metadata)
        if d.server_streaming:
            next(iter(answer), None)
            answer.cancel()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# --- the openai client and the CLI against a secure mesh -------------------------------------------


def _cli(mesh: Mesh, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMESH_STATE_DIR": str(mesh.log_dir / "state")}
    for k in ("LLMESH_TRUST", "LLMESH_TLS_CA_FILE", "LLMESH_TLS_CERT_FILE", "LLMESH_TLS_KEY_FILE"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "llmesh", *argv], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("which", ["tls_mesh", "token_mesh"])
def test_the_openai_client_is_served_with_an_api_key_and_refused_without(which, request):
    mesh: Mesh = request.getfixturevalue(which)
    made = _cli(mesh, "keys", "create", "--tenant", TENANT)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip().splitlines()[-1]
    client = OpenAI(base_url=mesh.layout.http_url + "/v1", api_key=key, max_retries=0, timeout=30)
    out = client.chat.completions.create(model=SIM, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content
    body = {"model": SIM, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    url = mesh.layout.http_url + "/v1/chat/completions"
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    assert httpx.post(url, json=body, headers={"authorization": "Bearer garbage"}, timeout=30).status_code == 401


@pytest.mark.parametrize("which", ["tls_mesh", "token_mesh"])
def test_the_cli_finds_the_secure_mesh_by_itself(which, request):
    mesh: Mesh = request.getfixturevalue(which)
    ports = ["--base-port", str(mesh.layout.base_port), "--http-port", str(mesh.layout.http_port)]
    status = _cli(mesh, "status", "--json", "--log-dir", str(mesh.log_dir), *ports)
    assert status.returncode == 0, status.stdout + status.stderr
    report = json.loads(status.stdout)
    assert all(s["health"] == "SERVING" for s in report["services"]), report
    assert any(e["endpoint_id"] == "engine-0" for e in report["endpoints"]), report
    listed = _cli(mesh, "models", *ports, "list")
    assert listed.returncode == 0, listed.stderr
    stats = _cli(mesh, "cache", "stats", *ports)
    assert stats.returncode == 0, stats.stderr


# --- the per-method matrix, mutual TLS --------------------------------------------------------------


@pytest.mark.parametrize("path", METHODS)
def test_tls_a_call_without_a_client_certificate_is_refused(tls_mesh, path):
    with _tls_channel(tls_mesh, path, None) as ch:
        assert _call(ch, path, _request(path, None)) == grpc.StatusCode.UNAVAILABLE  # the handshake fails
    with grpc.insecure_channel(_address(tls_mesh, path)) as ch:
        assert _call(ch, path, _request(path, None)) == grpc.StatusCode.UNAVAILABLE  # no plaintext either


@pytest.mark.parametrize("path", [m for m in METHODS if _disallowed(m)])
def test_tls_a_service_the_method_does_not_allow_is_denied(tls_mesh, path):
    caller = _instance(_disallowed(path))
    with _tls_channel(tls_mesh, path, caller) as ch:
        assert _call(ch, path, _request(path, caller)) == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("path", METHODS)
def test_tls_an_allowed_caller_gets_past_the_identity_check(tls_mesh, path):
    service = sorted(policy.allowed_callers(path))[0]
    caller = ENGINE_PROBE if service == "engine" else _instance(service)
    with _tls_channel(tls_mesh, path, caller) as ch:
        code = _call(ch, path, _request(path, caller))
    assert code not in REFUSED, f"{caller} calling {path}: {code}"


# --- the per-method matrix, signed tokens -----------------------------------------------------------


def _token(mesh: Mesh, instance: str, path: str, audience: str | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata ``instance`` sends on one call of ``path``, its token for ``audience`` (default:
    the service that serves ``path``), signed with its certificate's key."""
    files = identity_files(mesh.pki, instance)
    cert = x509.load_pem_x509_certificate(files.cert_file.read_bytes())
    signer = TokenSigner(read_principal(cert), load_private_key(files.key_file.read_bytes()),
                         cert.public_bytes(serialization.Encoding.DER), time.time)
    return ((TOKEN_KEY, signer.token(audience or _target(path), path)), (CERT_KEY, signer.cert_b64))


@pytest.mark.parametrize("path", METHODS)
def test_token_a_call_without_a_token_is_unauthenticated(token_mesh, path):
    with grpc.insecure_channel(_address(token_mesh, path)) as ch:
        assert _call(ch, path, _request(path, None)) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("path", [m for m in METHODS if _disallowed(m)])
def test_token_a_service_the_method_does_not_allow_is_denied(token_mesh, path):
    caller = _instance(_disallowed(path))
    with grpc.insecure_channel(_address(token_mesh, path)) as ch:
        code = _call(ch, path, _request(path, caller), _token(token_mesh, caller, path))
    assert code == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("path", METHODS)
def test_token_an_allowed_caller_gets_past_the_identity_check(token_mesh, path):
    service = sorted(policy.allowed_callers(path))[0]
    caller = ENGINE_PROBE if service == "engine" else _instance(service)
    with grpc.insecure_channel(_address(token_mesh, path)) as ch:
        code = _call(ch, path, _request(path, caller), _token(token_mesh, caller, path))
    assert code not in REFUSED, f"{caller} calling {path}: {code}"


STATS = "/llmesh.v1.Cache/Stats"


def test_token_a_replayed_token_is_refused(token_mesh):
    metadata = _token(token_mesh, "cli", STATS)
    with grpc.insecure_channel(_address(token_mesh, STATS)) as ch:
        assert _call(ch, STATS, _request(STATS, "cli"), metadata) == grpc.StatusCode.OK
        assert _call(ch, STATS, _request(STATS, "cli"), metadata) == grpc.StatusCode.UNAUTHENTICATED


def test_token_a_token_for_another_method_is_refused(token_mesh):
    # the cli's own token for Invalidate, sent with a Stats call (the cli may call both: only the binding
    # to the method refuses it)
    for_invalidate = _token(token_mesh, "cli", "/llmesh.v1.Cache/Invalidate")
    with grpc.insecure_channel(_address(token_mesh, STATS)) as ch:
        assert _call(ch, STATS, _request(STATS, "cli"), for_invalidate) == grpc.StatusCode.UNAUTHENTICATED


def test_token_a_token_for_another_service_is_refused(token_mesh):
    # the cli's token for Cache/Stats addressed to the scheduler, replayed against the cache
    other = _token(token_mesh, "cli", STATS, audience="scheduler")
    with grpc.insecure_channel(_address(token_mesh, STATS)) as ch:
        assert _call(ch, STATS, _request(STATS, "cli"), other) == grpc.StatusCode.UNAUTHENTICATED


REPORT = "/llmesh.v1.Scheduler/Report"


def test_an_engine_cannot_report_another_endpoint(tls_mesh, token_mesh):
    hijack = scheduler_pb2.EngineReport(endpoint_id="engine-0", address="127.0.0.1:1", backend="sim", models=[SIM])
    with _tls_channel(tls_mesh, REPORT, ENGINE_PROBE) as ch:
        assert _call(ch, REPORT, hijack) == grpc.StatusCode.PERMISSION_DENIED
    with grpc.insecure_channel(_address(token_mesh, REPORT)) as ch:
        assert _call(ch, REPORT, hijack, _token(token_mesh, ENGINE_PROBE, REPORT)) == grpc.StatusCode.PERMISSION_DENIED
    for mesh in (tls_mesh, token_mesh):  # the real engine-0 stays where it is
        status = _cli(mesh, "status", "--json", "--log-dir", str(mesh.log_dir), "--base-port",
                      str(mesh.layout.base_port), "--http-port", str(mesh.layout.http_port))
        engine = next(e for e in json.loads(status.stdout)["endpoints"] if e["endpoint_id"] == "engine-0")
        assert engine["address"] == mesh.layout.engine_address(0)

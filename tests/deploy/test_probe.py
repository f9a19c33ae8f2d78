"""`python -m llmesh.rpc.probe`, the health check of every image and compose service: its HTTP
mode against the metrics port's /healthz, its gRPC mode against a real gRPC server with
grpc.health.v1, plaintext and in "tls" trust (the probe dialling with its own certificate)."""

from __future__ import annotations

import asyncio
import os
import sys

from llmesh.metrics_http import start_metrics
from llmesh.rpc.identity import Credentials, Identity
from llmesh.rpc.pki import ensure_pki
from llmesh.rpc.server import GrpcServer, ServiceBinding
from llmesh.serving import ServingState
from prometheus_client import CollectorRegistry


async def _probe(address: str, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "llmesh.rpc.probe", address, *extra,
                                                stdout=asyncio.subprocess.PIPE,
                                                env={**os.environ, "LLMESH_TRUST": "local", **(env or {})})
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, out.decode().strip()


async def test_probe_exits_0_only_while_the_server_is_serving():
    server = GrpcServer("127.0.0.1:0", [])
    await server.start()
    address = f"127.0.0.1:{server.port}"
    try:
        assert await _probe(address) == (0, "SERVING")
        await server.set_serving(False)  # draining
        assert await _probe(address) == (1, "NOT_SERVING")
        assert await _probe(address, "--service", "llmesh.v1.NoSuch") == (1, "UNREACHABLE")
    finally:
        await server.stop(0)
    assert await _probe(address, "--timeout", "0.5") == (1, "UNREACHABLE")


async def test_http_probe_follows_the_grpc_health_state_on_the_metrics_port():
    serving = ServingState()
    metrics = await start_metrics(CollectorRegistry(), "127.0.0.1", 0, serving=serving)
    server = GrpcServer("127.0.0.1:0", [], serving=serving)
    where = f"127.0.0.1:{metrics.server_port}"
    try:
        assert await _probe(where, "--http") == (1, "NOT_SERVING")  # before the gRPC server serves
        await server.start()
        assert await _probe(where, "--http") == (0, "SERVING")
        assert await _probe(f"http://{where}/readyz") == (0, "SERVING")
        await server.set_serving(False)  # draining
        assert await _probe(f"http://{where}/healthz") == (1, "NOT_SERVING")
    finally:
        await server.stop(0)
        metrics.shutdown()
        metrics.server_close()
    assert await _probe(where, "--http", "--timeout", "0.5") == (1, "UNREACHABLE")


async def test_grpc_probe_uses_the_containers_own_certificate_in_tls_trust(tmp_path):
    pki = ensure_pki(tmp_path, [("scheduler", "scheduler-0"), ("engine", "engine-0")])

    def identity(instance: str, service: str) -> Identity:
        f = pki[instance]
        return Identity(service, "tls", Credentials.load(f.ca_file, f.cert_file, f.key_file))

    def env(instance: str, trust: str = "tls") -> dict[str, str]:
        f = pki[instance]
        return {"LLMESH_TRUST": trust, "LLMESH_TLS_CA_FILE": str(f.ca_file),
                "LLMESH_TLS_CERT_FILE": str(f.cert_file), "LLMESH_TLS_KEY_FILE": str(f.key_file)}

    def _bind(servicer, server):
        return None

    server = GrpcServer("127.0.0.1:0", [ServiceBinding("llmesh.v1.Scheduler", None, _bind)],
                        identity=identity("scheduler-0", "scheduler"))
    await server.start()
    address = f"127.0.0.1:{server.port}"
    try:
        assert await _probe(address, env=env("scheduler-0")) == (0, "SERVING")
        assert await _probe(address, "--service", "llmesh.v1.Scheduler", env=env("scheduler-0")) == (0, "SERVING")
        # Without a certificate the handshake fails, as Consul's gRPC check and the kubelet's did.
        assert await _probe(address, "--timeout", "1") == (1, "UNREACHABLE")
        # Another container's certificate expects another service at the address: refused.
        assert await _probe(address, "--timeout", "1", env=env("engine-0")) == (1, "UNREACHABLE")
        await server.set_serving(False)
        assert await _probe(address, env=env("scheduler-0")) == (1, "NOT_SERVING")
    finally:
        await server.stop(0)
    code, out = await _probe(address, env={**env("scheduler-0"), "LLMESH_TLS_CERT_FILE": str(tmp_path / "none.pem")})
    assert code == 1 and out.startswith("UNREACHABLE") and "none.pem" in out

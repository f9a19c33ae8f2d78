"""In "tls" trust every gRPC port needs a mesh certificate, which Consul's gRPC check cannot
present: a tls service registers an HTTP check on its metrics port's plaintext /healthz instead
(llmesh.service.health_url, llmesh.discovery.consul). Against the agent STAND-IN, which runs HTTP
checks as Consul does (2xx passing, 429 warning, anything else critical)."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmesh.cache.app import CacheApp
from llmesh.cache.config import CacheSettings
from llmesh.discovery.base import Instance
from llmesh.discovery.consul import ConsulRegistry
from llmesh.metrics_http import start_metrics
from llmesh.platform import build_platform
from llmesh.rpc.health import health_status
from llmesh.rpc.pki import ensure_pki
from llmesh.service import Registration, StartFailed, health_url, serve
from llmesh.settings import MeshSettings
from tests.integration.consul_standin import ConsulStandin

FAST = {"consul_check_interval_s": 0.2, "consul_check_timeout_s": 0.5, "consul_resync_s": 0.3,
        "consul_wait_s": 1.0}


def tls_mesh(tmp_path, standin: ConsulStandin) -> MeshSettings:
    files = ensure_pki(tmp_path / "pki", [("cache", "cache-1")])["cache-1"]
    return MeshSettings(trust="tls", discovery="consul", consul_address=standin.address, config_backend="none",
                        tls_ca_file=files.ca_file, tls_cert_file=files.cert_file, tls_key_file=files.key_file,
                        **FAST)


def check_of(standin: ConsulStandin, service: str) -> dict:
    """The one instance's service check ({} while it is not registered yet)."""
    _, _, entries = standin.get(f"/v1/health/service/{service}")
    assert len(entries) <= 1, entries
    return next((c for e in entries for c in e["Checks"] if c["CheckID"] != "serfHealth"), {})


async def until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_tls_service_passes_its_http_check_and_goes_critical_when_it_stops_serving(tmp_path, standin):
    mesh = tls_mesh(tmp_path, standin)
    platform = build_platform("cache", mesh)
    metrics = await start_metrics(platform.metrics, "127.0.0.1", 0, serving=platform.serving)
    app = CacheApp(CacheSettings(port=0, metrics_port=0), platform)
    await app.start()
    registration = Registration("cache", platform.registry, mesh, app.advertise_address, app.health_service,
                                metrics.server_port)
    try:
        # The gRPC port is mutual TLS: a plaintext grpc.health.v1 check (Consul's) cannot pass it.
        assert await health_status(app.advertise_address, app.health_service, timeout_s=1) == "UNREACHABLE"
        url = f"http://127.0.0.1:{metrics.server_port}/healthz"
        assert registration.instance.health_url == url
        assert await until(lambda: check_of(standin, "cache").get("Status") == "passing", 10)
        check = check_of(standin, "cache")
        assert check["Status"] == "passing" and check["Type"] == "http"
        assert check["Definition"]["HTTP"] == url and "GRPC" not in check["Definition"]
        assert check["Definition"]["Timeout"] == "0.2s"  # at most the interval, not Consul's 10 s default
        assert check["Definition"]["DeregisterCriticalServiceAfter"] == "60s"
        assert [i.instance_id for i in await platform.registry.resolve("cache")] == [registration.instance.instance_id]

        await app.server.set_serving(False)  # draining: /healthz answers 503, the check turns critical
        assert await until(lambda: check_of(standin, "cache").get("Status") == "critical", 5)
        assert await platform.registry.resolve("cache") == []
        await app.server.set_serving(True)
        assert await until(lambda: check_of(standin, "cache").get("Status") == "passing", 5)
    finally:
        await registration.end()
        await app.stop(0)
        await platform.close()
        metrics.shutdown()
        metrics.server_close()


@pytest.mark.parametrize("code, status", [(200, "passing"), (204, "passing"), (429, "warning"),
                                          (503, "critical"), (404, "critical"), (500, "critical")])
async def test_standin_runs_http_checks_as_consul_does(standin, code, status):
    class Answer(BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's naming
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    reg = ConsulRegistry(standin.address, check_interval_s=0.2, check_timeout_s=0.5, resync_s=0.3, wait_s=1.0)
    inst = Instance("web", "web-1", "127.0.0.1:1", health_url=f"http://127.0.0.1:{server.server_port}/healthz")
    try:
        await reg.register(inst)
        assert await until(lambda: check_of(standin, "web").get("Status") == status, 5)
        # Only passing instances are read (?passing): a warning one is left out like a critical one.
        assert await reg.resolve("web") == ([inst] if status == "passing" else [])
    finally:
        await reg.close()
        server.shutdown()
        server.server_close()
    # Nothing listening: critical.
    reg = ConsulRegistry(standin.address, check_interval_s=0.2, check_timeout_s=0.5, resync_s=0.3, wait_s=1.0)
    try:
        await reg.register(inst)
        assert await until(lambda: check_of(standin, "web").get("Status") == "critical", 5)
    finally:
        await reg.close()


async def test_tls_service_with_consul_and_no_metrics_port_does_not_start(tmp_path, standin):
    mesh = tls_mesh(tmp_path, standin)
    with pytest.raises(StartFailed, match="LLMESH_CACHE_METRICS_PORT"):
        await serve("cache", lambda platform: CacheApp(CacheSettings(port=0), platform), CacheSettings(port=0), mesh)


def test_only_tls_trust_asks_the_metrics_ports_healthz(tmp_path, standin):
    mesh = tls_mesh(tmp_path, standin)
    assert health_url("10.0.0.5:50054", mesh, 9090) == "http://10.0.0.5:9090/healthz"
    assert health_url("[fd00::5]:50054", mesh, 9090) == "http://[fd00::5]:9090/healthz"
    assert health_url("cache:50054", mesh, None) == ""  # no metrics port (etcd or static discovery)
    for trust in ("local", "token"):  # plaintext gRPC: Consul's gRPC check works, as before
        assert health_url("10.0.0.5:50054", mesh.model_copy(update={"trust": trust}), 9090) == ""

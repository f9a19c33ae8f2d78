"""A mesh on Consul discovery, against the agent STAND-IN (no Consul binary exists
here; tests/integration/consul_standin.py reproduces the documented agent behaviours):
every service registers with a gRPC check, serving goes on while the agent is killed
and restarted, every service registers again, routing follows an engine joining and
leaving, and a service with a watch in flight shuts down in under 2 s."""

from __future__ import annotations

import signal
import time

import pytest

from llmesh.testing import Mesh, Service, free_layout, wait_until
from tests.integration.consul_standin import ConsulStandin
from tests.e2e.conftest import ChatLoad, endpoints, openai_client, sim_engine

MSG = [{"role": "user", "content": "hi"}]
SERVICES = ("gateway", "scheduler", "modelmgr", "cache")


@pytest.fixture(scope="module")
def consul_mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("consulmesh")
    agent = ConsulStandin()
    agent.start()
    env = {"LLMESH_DISCOVERY": "consul", "LLMESH_CONSUL_ADDRESS": agent.address, "LLMESH_CONFIG_BACKEND": "none",
           "LLMESH_CONSUL_CHECK_INTERVAL_S": "0.5", "LLMESH_CONSUL_CHECK_TIMEOUT_S": "0.5",
           "LLMESH_CONSUL_RESYNC_S": "1", "LLMESH_CONSUL_WAIT_S": "30",
           "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "2", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "8"}
    mesh = Mesh(layout=free_layout(2), engines="sim,sim", model_dir=tmp / "models", log_dir=tmp / "logs", env=env)
    mesh.start(timeout_s=60)
    mesh.agent = agent
    yield mesh
    mesh.stop()
    agent.stop()


def passing(mesh: Mesh, service: str) -> list[str]:
    status, _, body = mesh.agent.get(f"/v1/health/service/{service}?passing=1")
    return sorted(f"{e['Service']['Address']}:{e['Service']['Port']}" for e in body) if status == 200 else []


def all_registered(mesh: Mesh) -> bool:
    return (all(passing(mesh, s) == [mesh.layout.address(s)] for s in SERVICES)
            and passing(mesh, "engine") == sorted(mesh.layout.engine_address(i) for i in range(2)))


def test_every_service_registers_with_a_passing_grpc_check(consul_mesh):
    assert wait_until(lambda: all_registered(consul_mesh), 10), consul_mesh.logs()
    _, _, entries = consul_mesh.agent.get("/v1/health/service/cache")
    assert entries[0]["Checks"][1]["Definition"]["GRPC"].endswith("/llmesh.v1.Cache")


def test_serving_goes_on_while_the_agent_is_killed_and_restarted(consul_mesh):
    with ChatLoad(openai_client(consul_mesh), "sim-small", MSG) as load:
        time.sleep(1)
        consul_mesh.agent.kill()
        before = load.done
        time.sleep(3)
        assert load.done > before  # served with the agent gone
        consul_mesh.agent.start()  # a fresh agent: every registration lost
        assert wait_until(lambda: all_registered(consul_mesh), 10), consul_mesh.logs()
        time.sleep(1)
    assert load.done > 20 and load.failures == []
    assert "re-registered" in (consul_mesh.log_dir / "gateway.log").read_text()


def test_routing_follows_an_engine_joining_and_leaving(consul_mesh, tmp_path):
    c = openai_client(consul_mesh)
    address = free_layout(1).engine_address(0)
    extra = sim_engine("joiner", address, tmp_path / "joiner.log", env=consul_mesh.env)
    extra.start()
    try:
        # Joins: registered with a passing check, and it finds the scheduler through Consul.
        assert wait_until(lambda: address in passing(consul_mesh, "engine"), 15), extra.log_path.read_text()
        assert wait_until(lambda: any(e.endpoint_id == "joiner" and e.healthy for e in endpoints(consul_mesh)), 10)
        extra.proc.kill()
        extra.proc.wait()
        for _ in range(20):  # routed only to the live engines from now on
            assert c.chat.completions.create(model="sim-small", messages=MSG).choices[0].message.content
        # Leaves Consul's passing list within a few checks (not after the 60 s reaper).
        assert wait_until(lambda: address not in passing(consul_mesh, "engine"), 5)
    finally:
        extra.stop()


def test_shutdown_with_a_watch_in_flight_takes_under_2_s(consul_mesh, redis_server, tmp_path):
    layout = free_layout(0)
    gateway = Service("llmesh.gateway", {  # a second replica: it must share a key store (Redis) to start
        **consul_mesh.env, "LLMESH_REDIS_URL": redis_server.url, "LLMESH_GATEWAY_PORT": str(layout.port("gateway")),
        "LLMESH_GATEWAY_HTTP_PORT": str(layout.http_port)}, tmp_path / "gateway2.log")
    gateway.start()
    try:
        assert wait_until(lambda: layout.address("gateway") in passing(consul_mesh, "gateway"), 15), \
            gateway.log_path.read_text()
        time.sleep(1)  # its watches of scheduler, modelmgr and cache now block for up to 30 s
        t0 = time.monotonic()
        assert gateway.stop(signal.SIGTERM, timeout_s=10) == 0, gateway.log_path.read_text()
        assert time.monotonic() - t0 < 2.0
    finally:
        gateway.stop()


def test_a_tls_mesh_registers_http_checks_that_pass(tmp_path):
    """Every gRPC port of `llmesh up --secure` is mutual TLS, which Consul's gRPC check cannot pass:
    each service registers an HTTP check of its metrics port's /healthz instead, and every one passes,
    so the instances the gateway and the engines look up through Consul (passing only) are all there."""
    agent = ConsulStandin()
    agent.start()
    env = {"LLMESH_DISCOVERY": "consul", "LLMESH_CONSUL_ADDRESS": agent.address, "LLMESH_CONFIG_BACKEND": "none",
           "LLMESH_CONSUL_CHECK_INTERVAL_S": "0.5", "LLMESH_CONSUL_CHECK_TIMEOUT_S": "0.5",
           "LLMESH_CONSUL_RESYNC_S": "1", "LLMESH_CONSUL_WAIT_S": "30"}
    mesh = Mesh(layout=free_layout(2), engines="sim,sim", model_dir=tmp_path / "models", log_dir=tmp_path / "logs",
                env=env, args=["--secure"])
    mesh.agent = agent
    try:
        mesh.start(timeout_s=90)
        assert wait_until(lambda: all_registered(mesh), 15), mesh.logs()
        for service in (*SERVICES, "engine"):
            _, _, entries = agent.get(f"/v1/health/service/{service}")
            for entry in entries:
                check = entry["Checks"][1]
                assert check["Type"] == "http" and check["Status"] == "passing", check
                assert check["Definition"]["HTTP"].endswith("/healthz") and "GRPC" not in check["Definition"]
    finally:
        mesh.stop()
        agent.stop()

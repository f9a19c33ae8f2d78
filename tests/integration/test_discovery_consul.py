"""The Consul adapter against a real agent (`consul agent -dev`), wherever `consul` is
on PATH. No Consul binary exists for these machines, so here it skips; the same
behaviours are tested against the agent stand-in (test_consul_standin.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.request

import pytest

from llmesh.discovery.base import Instance
from llmesh.discovery.consul import ConsulRegistry
from llmesh.rpc.server import GrpcServer
from llmesh.testing import free_ports, port_open, wait_until

pytestmark = pytest.mark.skipif(shutil.which("consul") is None,
                                reason="no `consul` binary on PATH (none is packaged for these machines)")


@pytest.fixture
def consul_agent(tmp_path):
    http, dns, serf_lan, serf_wan, server = free_ports(5)
    proc = subprocess.Popen(
        ["consul", "agent", "-dev", "-bind", "127.0.0.1", "-client", "127.0.0.1", "-data-dir", str(tmp_path),
         f"-http-port={http}", f"-dns-port={dns}", f"-serf-lan-port={serf_lan}", f"-serf-wan-port={serf_wan}",
         f"-server-port={server}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_until(lambda: port_open(http), 20)
    # The HTTP port opens before the dev server has elected itself; reads fail with
    # "No cluster leader" until /v1/status/leader names one.
    assert wait_until(lambda: _leader(http), 30, 0.2), "the dev agent elected no leader"
    yield f"127.0.0.1:{http}"
    proc.terminate()
    proc.wait(10)


def _leader(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status/leader", timeout=2) as resp:
            return bool(json.loads(resp.read()))
    except OSError:
        return False


async def test_register_with_grpc_health_check_resolve_and_deregister(consul_agent):
    server = GrpcServer("127.0.0.1:0", [])
    await server.start()
    reg = ConsulRegistry(consul_agent, check_interval_s=1)
    inst = Instance("cache", "cache-1", server.bound_address)  # the whole server's health ("")
    try:
        await reg.register(inst)
        for _ in range(100):  # passing once the agent's gRPC health check succeeds
            if await reg.resolve("cache") == [inst]:
                break
            await asyncio.sleep(0.1)
        assert await reg.resolve("cache") == [inst]
        watch = reg.watch("cache")
        assert await anext(watch) == [inst]
        await reg.deregister(inst)
        assert await reg.resolve("cache") == []
    finally:
        await reg.close()
        await server.stop(0)


async def test_a_named_grpc_check_drops_a_not_serving_instance_and_watch_follows(consul_agent):
    from llmesh.cache.app import CacheApp
    from llmesh.cache.config import CacheSettings
    app = CacheApp(CacheSettings(port=0))
    await app.start()
    reg = ConsulRegistry(consul_agent, check_interval_s=1, check_timeout_s=1, wait_s=2)
    inst = Instance("cache", "cache-2", app.advertise_address, app.health_service)
    watch = reg.watch("cache")
    try:
        assert await asyncio.wait_for(anext(watch), 5) == []
        await reg.register(inst)
        assert await asyncio.wait_for(anext(watch), 10) == [inst]
        await app.server.set_serving(False)
        assert await asyncio.wait_for(anext(watch), 10) == []
    finally:
        await watch.aclose()
        await reg.close()
        await app.stop(0)

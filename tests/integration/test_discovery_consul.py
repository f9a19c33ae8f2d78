"""The Consul adapter against a real agent (`consul agent -dev`), when one can run.
No Consul binary exists for these machines, so here it skips; compose runs Consul."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

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
    yield f"127.0.0.1:{http}"
    proc.terminate()
    proc.wait(10)


async def test_register_with_grpc_health_check_resolve_and_deregister(consul_agent):
    server = GrpcServer("127.0.0.1:0", [])
    await server.start()
    reg = ConsulRegistry(consul_agent, check_interval_s=1)
    inst = Instance("cache", "cache-1", server.bound_address)
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
        await server.stop(0)

"""Every long-lived task that depends on discovery survives a Consul agent that is
down (the agent STAND-IN, tests/integration/consul_standin.py, started late): the
gateway's scheduler feed and model catalog, its cache client, and an engine's
reporter keep running, then find their peers once the agent answers. Before this
fix the first connection error from py-consul ended each of them for good."""

from __future__ import annotations

import asyncio
import time

from opentelemetry.trace import INVALID_SPAN

from llmesh.discovery.base import Instance
from llmesh.discovery.consul import ConsulRegistry
from llmesh.engine.app import EngineApp
from llmesh.engine.config import EngineSettings
from llmesh.gateway.upstream.cache import CacheClient
from llmesh.gateway.upstream.catalog import ModelCatalog
from llmesh.gateway.upstream.feed import SchedulerFeed
from llmesh.gateway.upstream.picking import EndpointPicker
from llmesh.platform import build_platform
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings
from llmesh.settings import MeshSettings
from llmesh.testing import free_ports
from tests.component.helpers import completion_request
from tests.integration.consul_standin import ConsulStandin


async def test_feeds_cache_and_reporter_survive_the_agent_being_down():
    port = free_ports(1)[0]
    mesh = MeshSettings(discovery="consul", consul_address=f"127.0.0.1:{port}", config_backend="none",
                        consul_check_interval_s=0.2, consul_check_timeout_s=0.2, consul_resync_s=0.3,
                        consul_wait_s=1)
    gateway, engine_platform = build_platform("gateway", mesh), build_platform("engine", mesh)
    picker = EndpointPicker()
    feed = SchedulerFeed(gateway.resolver("scheduler", "unused:1"), picker)
    catalog = ModelCatalog(gateway.resolver("modelmgr", "unused:1"), picker, refresh_s=0.2)
    cache = CacheClient(gateway.resolver("cache", "unused:1"))
    tasks = [asyncio.create_task(feed.run()), asyncio.create_task(catalog.run())]
    engine = EngineApp(EngineSettings(backend="sim", model="sim-outage", port=0, endpoint_id="outage",
                                      scheduler_address="unused:1"), engine_platform)
    await engine.start()
    agent = ConsulStandin(port=port)
    scheduler = SchedulerApp(SchedulerSettings(port=0))
    registry = ConsulRegistry(mesh.consul_address, check_interval_s=0.2, check_timeout_s=0.2)
    try:
        await asyncio.sleep(2.5)  # the agent is down: every lookup fails meanwhile
        assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
        assert not engine.reporter._task.done()
        req = completion_request("sim-outage", "hi", timeout_s=5, max_tokens=2)
        t0 = time.monotonic()
        assert await cache.lookup(req, INVALID_SPAN) is None  # a miss, not an error in the request path
        assert time.monotonic() - t0 < 0.5  # and no longer than the cache's own timeout (0.25 s)

        agent.start()
        await scheduler.start()
        await registry.register(Instance("scheduler", "scheduler-1", scheduler.advertise_address,
                                         scheduler.health_service))
        for _ in range(200):  # the engine reports to the scheduler, the scheduler feeds the gateway
            if "sim-outage" in picker.models():
                break
            await asyncio.sleep(0.1)
        assert "sim-outage" in picker.models()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.stop(0)
        await scheduler.stop(0)
        await cache.close()
        for closing in (gateway, engine_platform):
            await closing.close()
        await registry.close()
        agent.stop()

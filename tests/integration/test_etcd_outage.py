"""etcd stops mid-run and comes back: the config in force stays, and changes made
after the restart are applied."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from llmesh.discovery.etcd import etcd_client
from llmesh.liveconfig.live import LiveConfig
from llmesh.liveconfig.stores import EtcdStore
from llmesh.testing import EtcdServer
from tests.integration.test_liveconfig_etcd import until


async def test_config_survives_an_etcd_restart(tmp_path):
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    client = etcd_client(server.address, timeout_s=2)
    store = EtcdStore(client, server.address)
    live = LiveConfig(store, CollectorRegistry(), "t", snapshot=tmp_path / "snap.yaml")
    try:
        await store.write("default:\n  max_attempts: 2\n")
        await live.start()
        assert live.current.default.max_attempts == 2
        server.stop()
        await asyncio.sleep(1.5)  # the watch breaks; the service keeps its config
        assert live.current.default.max_attempts == 2
        server.start()  # same ports, same data
        writer = etcd_client(server.address)
        for _ in range(50):
            try:
                await EtcdStore(writer, server.address).write("default:\n  max_attempts: 5\n")
                break
            except Exception:  # noqa: BLE001 - etcd still starting
                await asyncio.sleep(0.2)
        await until(lambda: live.current.default.max_attempts == 5, 10.0)
        await writer.close()
    finally:
        await live.stop()
        await client.close()
        server.stop()

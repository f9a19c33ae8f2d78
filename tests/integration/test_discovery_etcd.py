"""etcd discovery against a real etcd: register, resolve, watch, and a killed
process disappearing when its lease runs out."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
import uuid

from llmesh.discovery.base import Follower, Instance
from llmesh.discovery.etcd import EtcdRegistry, etcd_client


async def test_register_resolve_watch_deregister(etcd):
    client = etcd_client(etcd.address)
    reg = EtcdRegistry(client, prefix=f"/test/{uuid.uuid4().hex}", ttl_s=3)
    a = Instance("engine", "e-a", "127.0.0.1:1111")
    b = Instance("engine", "e-b", "127.0.0.1:2222")
    try:
        watch = reg.watch("engine")
        assert await anext(watch) == []
        await reg.register(a)
        assert await asyncio.wait_for(anext(watch), 2) == [a]
        await reg.register(b)
        assert sorted(await asyncio.wait_for(anext(watch), 2), key=lambda i: i.instance_id) == [a, b]
        await reg.deregister(a)
        assert await asyncio.wait_for(anext(watch), 2) == [b]
        follower = Follower(reg, "engine")
        assert await follower() == b.address
        await follower.close()
        await asyncio.sleep(3.5)  # past the TTL: the keepalive holds b
        assert await reg.resolve("engine") == [b]
        await watch.aclose()
    finally:
        await reg.close()
        await client.close()


async def test_killed_process_leaves_within_its_ttl(etcd):
    prefix = f"/test/{uuid.uuid4().hex}"
    script = textwrap.dedent(f"""
        import asyncio
        from llmesh.discovery.base import Instance
        from llmesh.discovery.etcd import EtcdRegistry, etcd_client
        async def main():
            reg = EtcdRegistry(etcd_client("{etcd.address}"), prefix="{prefix}", ttl_s=2)
            await reg.register(Instance("cache", "doomed", "127.0.0.1:3333"))
            print("registered", flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    client = etcd_client(etcd.address)
    reg = EtcdRegistry(client, prefix=prefix)
    try:
        assert proc.stdout.readline().strip() == "registered"
        assert [i.instance_id for i in await reg.resolve("cache")] == ["doomed"]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        while await reg.resolve("cache"):
            assert time.monotonic() - killed < 2 + 1.5, "still registered after its TTL"
            await asyncio.sleep(0.1)
    finally:
        proc.kill()
        await client.close()

"""Aliases live in the live config's traffic splits: the model manager's writer on
both config stores (a YAML file; a real etcd), read back by the same LiveConfig
every gateway runs; a document the services would reject is never written."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from prometheus_client import CollectorRegistry

from llmesh.discovery.etcd import etcd_client
from llmesh.liveconfig.live import LiveConfig
from llmesh.liveconfig.stores import EtcdStore, FileStore
from llmesh.errors import InvalidArgument
from llmesh.modelmgr.clients import ConfigSplits


@pytest.fixture(params=["file", "etcd"])
async def store(request, tmp_path):
    if request.param == "file":
        path = tmp_path / "llmesh.yaml"
        path.write_text("default: {max_attempts: 3}\nmodels:\n  m@1: {system_prompt: Be brief.}\n")
        yield FileStore(path)
        return
    server = request.getfixturevalue("etcd")
    client = etcd_client(server.address)
    s = EtcdStore(client, server.address, prefix=f"/test-{uuid.uuid4().hex[:8]}/config")
    await s.write("default: {max_attempts: 3}\nmodels:\n  m@1: {system_prompt: Be brief.}\n")
    yield s
    await client.close()


async def test_alias_moves_in_one_write_and_gateways_see_it(store):
    live = LiveConfig(store, CollectorRegistry(), "gateway")
    await live.start()
    try:
        splits = ConfigSplits(store)
        await splits.set_split("assistant", {"m@1": 1})
        await splits.set_split("assistant", {"m@1": 50, "m@2": 50})
        for _ in range(100):
            if "assistant" in live.current.splits and len(live.current.splits["assistant"].targets) == 2:
                break
            await asyncio.sleep(0.05)
        assert [(t.model, t.weight) for t in live.current.splits["assistant"].targets] == [("m@1", 50), ("m@2", 50)]
        assert live.current.default.max_attempts == 3  # the rest of the document is kept
        assert live.current.models["m@1"].system_prompt == "Be brief."
        assert await splits.targets() == {"m@1", "m@2"}
        before = await store.read()
        with pytest.raises(InvalidArgument, match="would be invalid"):
            await splits.set_split("m@1", {"m@2": 1})  # an alias may not shadow a model with a policy
        assert (await store.read()).text == before.text
    finally:
        await live.stop()

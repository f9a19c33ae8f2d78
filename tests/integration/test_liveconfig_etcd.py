"""Live config against a real etcd: hot apply, whole-document rejection with the last
good config kept, history and rollback, etcd going away and coming back."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from llmesh.discovery.etcd import etcd_client
from llmesh.liveconfig.live import ConfigUnavailable, LiveConfig
from llmesh.liveconfig.stores import EtcdStore

GOOD = "default:\n  system_prompt: 'You are terse.'\n"


async def until(predicate, timeout_s: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


@pytest.fixture
async def store(etcd):
    client = etcd_client(etcd.address)
    yield EtcdStore(client, etcd.address, prefix=f"/test/{uuid.uuid4().hex}")
    await client.close()


@pytest.fixture
async def live(store, tmp_path):
    metrics = CollectorRegistry()
    cfg = LiveConfig(store, metrics, "test", snapshot=tmp_path / "snap.yaml")
    cfg.metrics = metrics
    await cfg.start()
    yield cfg
    await cfg.stop()


def rejected(live) -> float:
    return live.metrics.get_sample_value("llmesh_config_rejected_total", {"service": "test"}) or 0.0


async def test_a_change_applies_within_one_second(store, live):
    await store.write(GOOD)
    took = await until(lambda: live.current.default.system_prompt == "You are terse.", 1.0)
    assert took < 1.0
    await store.write("default:\n  max_attempts: 3\n  system_prompt: 'Be kind.'\n")
    await until(lambda: live.current.default.max_attempts == 3, 1.0)
    assert live.current.default.system_prompt == "Be kind."


async def test_an_invalid_change_is_rejected_whole_and_the_last_good_stays(store, live):
    rev = await store.write(GOOD)
    await until(lambda: live.revision == rev, 1.0)
    # one valid change and one invalid one in the same document: neither applies
    bad = await store.write("default:\n  system_prompt: 'changed'\n  max_attempts: 0\n")
    await until(lambda: rejected(live) == 1.0, 1.0)
    assert live.current.default.system_prompt == "You are terse." and live.revision == rev
    await store.write("nonsense: [1, 2")  # not even YAML
    await until(lambda: rejected(live) == 2.0, 1.0)
    assert live.revision == rev < bad
    await store.write("splits:\n  a: {targets: [{model: a, weight: 1}]}\n")  # semantic rule
    await until(lambda: rejected(live) == 3.0, 1.0)
    assert live.revision == rev


async def test_every_version_is_kept_and_rollback_restores_one(store, live):
    texts = [f"default:\n  max_attempts: {n}\n" for n in (1, 2, 3)]
    revs = [await store.write(t) for t in texts]
    history = await store.history()
    assert [v.revision for v in history] == revs and [v.text for v in history] == texts
    await until(lambda: live.current.default.max_attempts == 3, 1.0)
    first = next(v for v in history if v.revision == revs[0])
    await store.write(first.text)  # what `llmesh config rollback REV` does
    await until(lambda: live.current.default.max_attempts == 1, 1.0)


async def test_start_without_backend_uses_snapshot_or_says_where_it_looked(tmp_path):
    from llmesh.liveconfig.stores import EtcdStore as Store

    dead = "127.0.0.1:1"
    client = etcd_client(dead, timeout_s=1)
    snap = tmp_path / "snap.yaml"
    with pytest.raises(ConfigUnavailable) as info:
        await LiveConfig(Store(client, dead), CollectorRegistry(), "t", snapshot=snap, start_timeout_s=1).start()
    assert dead in str(info.value) and str(snap) in str(info.value)
    snap.write_text("# revision 7\ndefault:\n  max_attempts: 4\n")
    cfg = LiveConfig(Store(client, dead), CollectorRegistry(), "t", snapshot=snap, start_timeout_s=1)
    await cfg.start()
    assert cfg.current.default.max_attempts == 4 and cfg.revision == 7
    await cfg.stop()

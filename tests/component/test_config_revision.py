"""The tests' wait for a config change (llmesh.testing.wait_for_config_revision) against a
service's real parts: LiveConfig following a watched file, its llmesh_config_revision gauge
served on /metrics. It returns once the written revision is in force, and fails naming
the service, the revision it runs and its rejections when a document is refused."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from llmesh.liveconfig.live import LiveConfig
from llmesh.liveconfig.stores import FileStore
from llmesh.metrics_http import serve_metrics
from llmesh.testing import free_ports, wait_for_config_revision, write_config_file


@pytest.fixture
async def service(tmp_path):
    """A service's live config on a file, its /metrics on a free port."""
    registry = CollectorRegistry()
    path = tmp_path / "llmesh.yaml"
    write_config_file(path, "default: {max_attempts: 2}\n")
    live = LiveConfig(FileStore(path), registry, "gateway")
    await live.start()
    port = free_ports(1)[0]
    server = serve_metrics(registry, "127.0.0.1", port)
    yield path, live, {"gateway": port}
    server.shutdown()
    await live.stop()


async def test_returns_once_the_written_revision_is_in_force(service):
    path, live, ports = service
    await asyncio.to_thread(wait_for_config_revision, ports, live.revision, 5.0)  # the one it started on
    revision = write_config_file(path, "default: {max_attempts: 3}\n")
    assert revision == path.stat().st_mtime_ns
    await asyncio.to_thread(wait_for_config_revision, ports, revision, 5.0)
    assert live.revision == revision and live.current.default.max_attempts == 3


async def test_a_rejected_document_fails_naming_the_service_and_its_rejection(service):
    path, live, ports = service
    good = live.revision
    bad = write_config_file(path, "default: {max_attempts: 0}\n")
    with pytest.raises(AssertionError, match=rf"config revision {bad} not in force within 1.0 s: "
                                             r"gateway at \[[0-9.e+]+\] \(rejected 1.0\)"):
        await asyncio.to_thread(wait_for_config_revision, ports, bad, 1.0)
    assert live.revision == good and live.current.default.max_attempts == 2


async def test_a_service_that_does_not_answer_is_named(tmp_path):
    port = free_ports(1)[0]
    with pytest.raises(AssertionError, match=r"engine-0 at no revision \(rejected 0\)"):
        await asyncio.to_thread(wait_for_config_revision, {"engine-0": port}, 1, 0.2)

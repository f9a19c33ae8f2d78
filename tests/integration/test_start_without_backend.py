"""A service whose config lives in etcd, started while etcd is unreachable: it exits
with a message naming the address it tried, or starts from its snapshot."""

from __future__ import annotations

import asyncio
import signal

from llmesh.rpc.health import health_status
from llmesh.testing import Service, free_ports


def cache_service(tmp_path, port: int) -> Service:
    return Service("llmesh.cache", {
        "LLMESH_CONFIG_BACKEND": "etcd", "LLMESH_ETCD_ADDRESS": "127.0.0.1:1",
        "LLMESH_STATE_DIR": str(tmp_path / "state"), "LLMESH_CACHE_PORT": str(port)}, tmp_path / "cache.log")


def test_no_backend_and_no_snapshot_exits_naming_the_address(tmp_path):
    svc = cache_service(tmp_path, free_ports(1)[0])
    svc.start()
    assert svc.proc.wait(timeout=30) == 1
    log = svc.log_path.read_text()
    assert "127.0.0.1:1" in log and "snapshot" in log


async def test_no_backend_but_a_snapshot_starts_from_it(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "cache-config.yaml").write_text("# revision 3\ndefault: {max_attempts: 3}\n")
    port = free_ports(1)[0]
    svc = cache_service(tmp_path, port)
    svc.start()
    try:
        for _ in range(100):
            if await health_status(f"127.0.0.1:{port}") == "SERVING":
                break
            await asyncio.sleep(0.1)
        assert await health_status(f"127.0.0.1:{port}") == "SERVING"
        assert "starting from the snapshot" in svc.log_path.read_text()
    finally:
        assert svc.stop(signal.SIGTERM) == 0

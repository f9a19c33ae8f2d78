"""A mesh on etcd: services register with leases, the config lives in etcd and is
hot-reloaded under load, bad config is rejected, rollback works, a killed engine
disappears, and serving goes on while etcd is down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import openai
import pytest

import httpx

from llmesh.testing import EtcdServer, Mesh, free_layout, wait_until
from tests.e2e.conftest import ChatLoad, openai_client, sim_engine

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def etcd_mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("etcdmesh")
    etcd = EtcdServer(tmp / "etcd")
    etcd.start()
    prefix = f"/t/{uuid.uuid4().hex}"
    env = {"LLMESH_DISCOVERY": "etcd", "LLMESH_CONFIG_BACKEND": "etcd", "LLMESH_ETCD_ADDRESS": etcd.address,
           "LLMESH_DISCOVERY_PREFIX": f"{prefix}/services", "LLMESH_CONFIG_PREFIX": f"{prefix}/config",
           "LLMESH_REGISTRY_TTL_S": "2", "LLMESH_STATE_DIR": str(tmp / "state"),
           "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "2", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "8"}
    mesh = Mesh(layout=free_layout(2), engines="sim,sim", model_dir=tmp / "models", log_dir=tmp / "logs", env=env)
    try:  # etcd stops even if the mesh does not start
        mesh.start(timeout_s=60)
        mesh.etcd = etcd
        yield mesh
    finally:
        mesh.stop()
        etcd.stop()


def config_cli(mesh: Mesh, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **mesh.env}
    return subprocess.run([sys.executable, "-m", "llmesh", "config", *args], env=env, capture_output=True,
                          text=True, timeout=30)


def registered(mesh: Mesh, service: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", (
        "import asyncio, sys\n"
        "from llmesh.discovery.etcd import EtcdRegistry, etcd_client\n"
        "async def main():\n"
        f"    c = etcd_client('{mesh.etcd.address}')\n"
        f"    r = EtcdRegistry(c, prefix='{mesh.env['LLMESH_DISCOVERY_PREFIX']}')\n"
        f"    print(' '.join(i.address for i in await r.resolve('{service}')))\n"
        "    await c.close()\n"
        "asyncio.run(main())\n")], capture_output=True, text=True, timeout=30)
    return out.stdout.split()


def test_every_service_registers_in_etcd(etcd_mesh):
    for service in ("gateway", "scheduler", "modelmgr", "cache"):
        assert registered(etcd_mesh, service) == [etcd_mesh.layout.address(service)]
    assert sorted(registered(etcd_mesh, "engine")) == sorted(
        [etcd_mesh.layout.engine_address(0), etcd_mesh.layout.engine_address(1)])


def test_config_hot_reload_under_load_drops_nothing(etcd_mesh, tmp_path):
    c = openai_client(etcd_mesh)
    with ChatLoad(c, "sim-small", MSG) as load:
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="fast", messages=MSG)
        doc = tmp_path / "split.yaml"
        doc.write_text("splits:\n  fast:\n    targets: [{model: sim-small, weight: 1}]\n")
        applied = config_cli(etcd_mesh, "apply", "-f", str(doc))
        assert applied.returncode == 0, applied.stderr
        t0 = time.monotonic()
        assert wait_until(lambda: "fast" in {m.id for m in c.models.list()}, 1.0)
        assert c.chat.completions.create(model="fast", messages=MSG).choices[0].message.content
        assert time.monotonic() - t0 < 1.5
        for n in (1, 2, 3):  # each one in force under the load before the next
            out = config_cli(etcd_mesh, "set", "default.max_attempts", str(n))
            assert out.returncode == 0 and out.stdout.startswith("applied as revision "), out.stderr
            etcd_mesh.wait_for_config(int(out.stdout.split()[-1]))
    assert load.done > 20 and load.failures == []


def test_invalid_config_is_rejected_and_the_last_good_stays(etcd_mesh, tmp_path):
    c = openai_client(etcd_mesh)
    bad = tmp_path / "bad.yaml"
    bad.write_text("splits: {}\ndefault: {max_attempts: 0}\n")
    refused = config_cli(etcd_mesh, "apply", "-f", str(bad))
    assert refused.returncode == 1 and "max_attempts" in refused.stderr
    # Written behind the tool's back, straight into etcd: the services refuse it.
    script = (
        "import asyncio\n"
        "from llmesh.discovery.etcd import etcd_client\n"
        "from llmesh.liveconfig.stores import EtcdStore\n"
        "async def main():\n"
        f"    cl = etcd_client('{etcd_mesh.etcd.address}')\n"
        f"    await EtcdStore(cl, '', '{etcd_mesh.env['LLMESH_CONFIG_PREFIX']}').write(open('{bad}').read())\n"
        "    await cl.close()\n"
        "asyncio.run(main())\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    log = etcd_mesh.log_dir / "gateway.log"
    assert wait_until(lambda: "config rejected" in log.read_text(), 2.0)
    line = next(json.loads(x) for x in log.read_text().splitlines() if "config rejected" in x)
    assert "max_attempts" in line["reason"]
    assert c.chat.completions.create(model="fast", messages=MSG).choices[0].message.content  # alias kept
    metrics = httpx.get(f"http://127.0.0.1:{etcd_mesh.layout.metrics_port('gateway')}/metrics").text
    assert 'llmesh_config_rejected_total{service="gateway"} 1.0' in metrics


def test_history_and_rollback(etcd_mesh):
    history = config_cli(etcd_mesh, "history")
    revisions = [int(line.split()[0]) for line in history.stdout.splitlines()]
    assert len(revisions) >= 4
    first = revisions[0]  # the split alone, before the `set`s
    rolled = config_cli(etcd_mesh, "rollback", str(first))
    assert rolled.returncode == 0, rolled.stderr
    got = config_cli(etcd_mesh, "get").stdout
    assert "fast" in got and "max_attempts" not in got
    assert config_cli(etcd_mesh, "rollback", "999999999").returncode == 1


def test_killed_engine_leaves_discovery_and_routing(etcd_mesh, tmp_path):
    c = openai_client(etcd_mesh)
    address = free_layout(1).engine_address(0)
    extra = sim_engine("extra", address, tmp_path / "extra.log", env=etcd_mesh.env)
    extra.start()
    try:
        assert wait_until(lambda: address in registered(etcd_mesh, "engine"), 10), extra.log_path.read_text()
        extra.proc.kill()
        extra.proc.wait()
        killed = time.monotonic()
        for _ in range(20):  # routed only to the live engines from now on
            assert c.chat.completions.create(model="sim-small", messages=MSG).choices[0].message.content
        assert wait_until(lambda: address not in registered(etcd_mesh, "engine"), 6)
        assert time.monotonic() - killed < 2 + 4  # TTL 2 s, plus the lookups' own time
    finally:
        extra.stop()


def test_serving_goes_on_while_etcd_is_down(etcd_mesh, tmp_path):
    c = openai_client(etcd_mesh)
    etcd_mesh.etcd.stop()
    try:
        for _ in range(10):
            assert c.chat.completions.create(model="fast", messages=MSG).choices[0].message.content
    finally:
        etcd_mesh.etcd.start()
    doc = tmp_path / "after.yaml"
    doc.write_text("splits:\n  after-restart:\n    targets: [{model: sim-small, weight: 1}]\n")
    assert wait_until(lambda: config_cli(etcd_mesh, "apply", "-f", str(doc)).returncode == 0, 20, 0.5)
    assert wait_until(lambda: "after-restart" in {m.id for m in c.models.list()}, 15)

"""Flow control through a whole mesh of sim engines (two engines, two running slots each and no
queue of their own): a tenant that floods the gateway with many times the engines' slots in
concurrent streams does not starve a light tenant. Without flow control the light tenant's
requests would meet full engines and get 429 with the flood's; with it every request waits its
fair turn in the gateway and is answered, and the light one's turns come first."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import httpx
import pytest

from llmesh.testing import Mesh, free_layout, wait_until
from tests.e2e.conftest import endpoints

MODEL = "sim-small"
SLOTS = 4  # 2 engines x 2 running
CONFIG = {
    "tenants": {"heavy": {}, "light": {}},
    "flow_control": {"enabled": True, "max_queued_per_tenant": 64},
}


@pytest.fixture(scope="module")
def fair_mesh(tmp_path_factory, real_model_dir):
    root = tmp_path_factory.mktemp("flow")
    config = root / "llmesh.yaml"
    config.write_text(json.dumps(CONFIG))
    logs = root / "logs"
    keys = {tenant: subprocess.run(
        [sys.executable, "-m", "llmesh", "keys", "create", "--tenant", tenant, "--keys-file",
         str(logs / "state" / "keys.json")], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        for tenant in ("heavy", "light")}
    mesh = Mesh(layout=free_layout(n_engines=2), engines="sim:2", model_dir=real_model_dir, log_dir=logs,
                env={"LLMESH_CONFIG_FILE": str(config), "LLMESH_ENGINE_MAX_RUNNING": "2",
                     "LLMESH_ENGINE_MAX_WAITING": "0", "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "20",
                     "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "8", "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600",
                     "LLMESH_GATEWAY_AUDIT": "false"},
                args=["--no-cache"])
    mesh.start(timeout_s=240)
    assert wait_until(lambda: sum(e.healthy for e in endpoints(mesh)) == 2, 60), endpoints(mesh)
    yield mesh, keys
    assert mesh.stop() == 0, mesh.logs()


async def ask(client: httpx.AsyncClient, url: str, key: str) -> int:
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with client.stream("POST", url, json=body, headers={"authorization": f"Bearer {key}"}) as resp:
        await resp.aread()
        return resp.status_code


def test_a_flooding_tenant_does_not_starve_a_light_one(fair_mesh):
    mesh, keys = fair_mesh
    url = mesh.layout.http_url + "/v1/chat/completions"

    async def run() -> tuple[list[int], list[int]]:
        heavy: list[int] = []
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as client:
            async def flood() -> None:
                while not stop.is_set():
                    heavy.append(await ask(client, url, keys["heavy"]))

            flooders = [asyncio.create_task(flood()) for _ in range(6 * SLOTS)]
            await asyncio.sleep(1.0)  # the flood has every slot and a queue behind them
            light = [await ask(client, url, keys["light"]) for _ in range(8)]
            stop.set()
            await asyncio.gather(*flooders)
        return heavy, light

    heavy, light = asyncio.run(run())
    assert light == [200] * 8  # none refused, none starved
    assert heavy and set(heavy) == {200}  # the flood waited too: no 429 while its queue had room
    metrics = httpx.get(f"http://127.0.0.1:{mesh.layout.metrics_port('gateway')}/metrics").text
    waits = {tenant: _mean_wait(metrics, tenant) for tenant in ("heavy", "light")}
    assert waits["heavy"] > 0  # it queued: the engines were saturated
    assert waits["light"] < waits["heavy"] / 2, waits  # the light tenant's turns came first


def _mean_wait(metrics: str, tenant: str) -> float:
    def value(name: str) -> float:
        found = re.findall(rf'^llmesh_flow_wait_seconds_{name}\{{[^}}]*tenant="{tenant}"[^}}]*\}} (\S+)$', metrics,
                           re.M)
        return sum(float(v) for v in found)

    count = value("count")
    assert count, f"no waits recorded for {tenant}"
    return value("sum") / count

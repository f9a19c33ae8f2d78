"""Sixteen calibrated sim engines on this machine behind one gateway: all register,
traffic spreads over them, and their KV block events reach the scheduler."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from openai import AsyncOpenAI

from llmesh.testing import Mesh, free_layout, wait_until
from tests.e2e.conftest import endpoints

N = 16
MODEL = "sim-small"
# 40 words: the sim tokenizes by word, so two full 16-token KV blocks plus the role tag.
SHARED = "policy " * 40


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, real_model_dir):
    layout = free_layout(n_engines=N)
    mesh = Mesh(layout=layout, engines=f"sim:{N}", model_dir=real_model_dir, log_dir=tmp_path_factory.mktemp("fleet"),
                env={"LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "8", "LLMESH_ENGINE_SIM_DECODE_MS_PER_SEQ": "0.5",
                     "LLMESH_ENGINE_SIM_PREFILL_MS_PER_TOKEN": "0.2", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "8",
                     "LLMESH_ENGINE_MAX_RUNNING": "4", "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600"},
                args=["--no-cache"])
    mesh.start(timeout_s=240)
    yield mesh
    assert mesh.stop() == 0, mesh.logs()


def test_sixteen_sim_engines_serve_one_model(fleet):
    assert wait_until(lambda: sum(e.healthy for e in endpoints(fleet)) == N, 60), endpoints(fleet)

    async def run() -> list:
        client = AsyncOpenAI(base_url=fleet.layout.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        sem = asyncio.Semaphore(32)

        async def one(i: int):
            async with sem:
                return await client.chat.completions.create(
                    model=MODEL, max_tokens=8,
                    messages=[{"role": "system", "content": SHARED}, {"role": "user", "content": f"question {i}"}])

        try:
            return await asyncio.gather(*(one(i) for i in range(96)))
        finally:
            await client.close()

    answers = asyncio.run(run())
    assert len(answers) == 96 and all(a.choices[0].message.content for a in answers)
    served = 0
    for i in range(N):
        text = httpx.get(f"http://127.0.0.1:{fleet.layout.metrics_port(f'engine-{i}')}/metrics").text
        done = sum(float(v) for v in re.findall(r'^vllm:request_success_total\{[^}]*\} (\S+)$', text, re.M))
        served += done > 0
    assert served >= N // 2, f"only {served} of {N} engines served"
    # Every engine that served holds the shared prompt's blocks, and said so to the scheduler.
    assert wait_until(lambda: sum(e.kv_blocks >= 2 for e in endpoints(fleet)) >= served, 5), \
        [(e.endpoint_id, e.kv_blocks) for e in endpoints(fleet)]
    # ... with how they name them, so a router can hash a request the same way
    assert {(e.kv_hash.kind, e.kv_hash.block_size) for e in endpoints(fleet)} == {("llmesh", 16)}

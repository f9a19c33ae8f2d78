"""Alias -> model (weighted, sticky per user), the model's policy and defaults (the
live config's ``splits`` and ``models``); 404 for a model nobody serves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from llmesh.errors import ModelNotFound
from llmesh.liveconfig.schema import MeshConfig
from llmesh.gateway.context import Catalog, Context
from llmesh.gateway.domain.policy import apply_policy, route
from llmesh.gateway.stages.base import Stage


class RouteStage(Stage):
    def __init__(self, catalog: Catalog, config: Callable[[], MeshConfig]):
        self._catalog = catalog
        self._config = config

    async def admit(self, ctx: Context) -> None:
        req = ctx.req
        config = self._config()
        target, policy = route(req.model, config, req.user or req.request_id)
        if not self._catalog.known(target) and config.provider_for(target) is None:
            raise ModelNotFound(req.model)
        prompt, sampling = apply_policy(req.prompt, req.sampling, policy)
        if target != req.model or prompt is not req.prompt or sampling is not req.sampling:
            ctx.req = replace(req, model=target, prompt=prompt, sampling=sampling)
        ctx.policy = policy
        ctx.record.model = target

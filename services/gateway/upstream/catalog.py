"""The models clients may ask for: the registry's (ModelManager.ListModels, refreshed
in the background), those an engine serves, and scaled models with no replica yet. A
known model no engine serves is 503, not 404; the model list names only what can
answer (domain/listing.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from llmesh.backoff import Backoff
from llmesh.discovery.base import Resolver
from llmesh.errors import DiscoveryError
from llmesh.liveconfig.schema import MeshConfig
from llmesh.rpc.channels import mesh_channel
from llmesh.rpc.identity import Identity
from llmesh.v1 import modelmgr_pb2, modelmgr_pb2_grpc
from llmesh.gateway.upstream.picking import EndpointPicker
from llmesh.gateway.upstream.rpc import why

log = logging.getLogger("llmesh.gateway.upstreams")


class ModelCatalog:
    """Models the gateway accepts: the registry's, plus any an engine serves (the
    sim backend's, say). Refreshed in the background, never on the request path."""

    def __init__(self, resolve: Resolver | None, picker: EndpointPicker, refresh_s: float = 10.0,
                 identity: Identity | None = None):
        self._resolve = resolve
        self._identity = identity
        self._picker = picker
        self._refresh = refresh_s
        self._registry: set[str] = set()

    def known(self, model: str) -> bool:
        return model in self._registry or model in self._picker.seen_models()

    async def run(self) -> None:
        """Every ``refresh_s``; while the registry is unreachable, again sooner (backing off
        up to ``refresh_s``), so a registry that comes back is seen within a second or two."""
        if self._resolve is None:
            return
        backoff = Backoff(initial_s=min(1.0, self._refresh), max_s=self._refresh)
        while True:
            try:
                async with mesh_channel(await self._resolve(), "modelmgr", self._identity) as channel:
                    resp = await modelmgr_pb2_grpc.ModelManagerStub(channel).ListModels(
                        modelmgr_pb2.ListModelsRequest(), timeout=10)
                self._registry = {m.name for m in resp.models}
                backoff.reset()
                await asyncio.sleep(self._refresh)
            except (grpc.aio.AioRpcError, DiscoveryError) as exc:
                log.warning("model registry unreachable; keeping the last catalog", extra={"error": why(exc)})
                await backoff.sleep()


class ScaledCatalog:
    """A scaled model is a model clients may ask for even while none of its replicas runs."""

    def __init__(self, inner: ModelCatalog, config: Callable[[], MeshConfig]):
        self._inner = inner
        self._config = config

    def known(self, model: str) -> bool:
        return self._inner.known(model) or model in self._config().autoscaling.models

"""A gateway as composed (GatewayApp), in process, with sim engines put straight into its
endpoint table and two tenants' API keys: what the Batch API tests drive with the official
``openai`` client (in a thread: it is synchronous)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from openai import OpenAI

from llmesh.keys import new_key
from llmesh.platform import build_platform, standalone_platform
from llmesh.testing import write_config_file
from llmesh.gateway.app import GatewayApp
from llmesh.gateway.config import GatewaySettings
from llmesh.gateway.upstream.picking import Endpoint


@dataclass
class BatchGateway:
    app: GatewayApp
    keys: dict[str, str]  # tenant -> plaintext API key

    def client(self, tenant: str, timeout: float = 30) -> OpenAI:
        port = self.app._uvicorn.servers[0].sockets[0].getsockname()[1]
        return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=self.keys[tenant], timeout=timeout,
                      max_retries=0)


@contextlib.asynccontextmanager
async def batch_gateway(state: Path, endpoints: list[Endpoint], redis_url: str | None = None,
                        tenants: tuple[str, ...] = ("acme", "globex"), config_extra: str = "",
                        **settings) -> AsyncIterator[BatchGateway]:
    state.mkdir(parents=True, exist_ok=True)
    config = state / "llmesh.yaml"
    tenant_lines = "".join(f"  {t}: {{}}\n" for t in tenants)
    write_config_file(config, "tenants:\n" + tenant_lines + config_extra)
    mesh = standalone_platform("gateway").settings.model_copy(update={
        "config_backend": "file", "config_file": config, "state_dir": state, "redis_url": redis_url})
    platform = build_platform("gateway", mesh)
    await platform.config.start()
    app = GatewayApp(GatewaySettings(port=0, http_port=0, guard_workers=0, cache_address=None, modelmgr_address=None,
                                     require_auth=True, **settings), platform)
    keys = {}
    for tenant in tenants:
        plaintext, record = new_key(tenant)
        await app.keys.put(record)
        keys[tenant] = plaintext
    app.picker.replace_all(endpoints)
    await app.start()
    try:
        yield BatchGateway(app, keys)
    finally:
        await app.stop(2.0)
        await platform.config.stop()

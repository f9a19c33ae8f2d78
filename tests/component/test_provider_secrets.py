"""A config writer cannot steer the gateway's secrets to a provider, against the gateway as
composed (GatewayApp: its settings, its live config following a file, its provider client)
and a fake provider (``helpers.RecordingProvider``: an HTTP server on loopback, in this
process, standing in for an external OpenAI-compatible API) that records the Authorization
header of every call.

A config that points ``api_key_file`` at the mesh CA's key (or names a variable off the
allow-list, or a plain-http URL off loopback) is refused when applied: the last good config
stays, the refusal is logged and counted, and the CA key never reaches the provider. A
provider that gets past the config anyway is refused at call time, before anything is sent."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from llmesh.errors import Unavailable
from llmesh.liveconfig.schema import Provider
from llmesh.platform import build_platform, standalone_platform
from llmesh.settings import MeshSettings
from llmesh.testing import wait_until, write_config_file
from llmesh.types import Delta
from llmesh.gateway.app import GatewayApp
from llmesh.gateway.config import GatewaySettings
from tests.component.helpers import completion_request, recording_provider

CA_KEY = "-----BEGIN PRIVATE KEY-----\nMESH-CA-SECRET\n-----END PRIVATE KEY-----\n"
# The mesh's CA certificate setting: LLMESH_TLS_CA_FILE once the mesh has TLS settings, the
# service secret before (either way a file the mesh's own secrets sit beside).
MESH_CA_SETTING = "tls_ca_file" if "tls_ca_file" in MeshSettings.model_fields else "service_secret_file"


@pytest.fixture
async def fake_provider():
    async with recording_provider() as (fake, base_url):
        yield fake, base_url


@pytest.fixture
async def gateway(tmp_path, monkeypatch):
    """The gateway's composition root over a live config file: key directory <state>/provider-keys
    (the default), OPENAI_API_KEY allowed; the mesh's certificates and the CA key in <state>/tls."""
    state, tls = tmp_path / "state", tmp_path / "state" / "tls"
    (state / "provider-keys").mkdir(parents=True)
    tls.mkdir()
    (state / "provider-keys" / "openai").write_text("sk-good\n")
    (tls / "ca.pem").write_text(f"-----BEGIN CERTIFICATE-----\n{'A' * 64}\n-----END CERTIFICATE-----\n")
    (tls / "ca-key.pem").write_text(CA_KEY)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("LLMESH_CONSUL_TOKEN", "consul-secret")
    config = tmp_path / "llmesh.yaml"
    write_config_file(config, "{}\n")
    # The one-machine mesh settings (static discovery), with the config file and the state directory here.
    mesh = standalone_platform("gateway").settings.model_copy(update={
        "config_backend": "file", "config_file": config, "state_dir": state, MESH_CA_SETTING: tls / "ca.pem"})
    platform = build_platform("gateway", mesh)
    await platform.config.start()  # as the runner does: the first document before the app is built
    app = GatewayApp(GatewaySettings(port=0, http_port=0, audit=False, guard_workers=0, cache_address=None,
                                     provider_key_envs="OPENAI_API_KEY"), platform)
    app.registry = platform.metrics  # the test reads the rejections here
    try:
        yield app, config, tls
    finally:
        await platform.config.stop()
        await app.providers.close()


def _doc(base_url: str, **key: str) -> str:
    return orjson.dumps({"providers": {"hosted": {"base_url": base_url, "models": {"hosted": "remote"}, **key}}}
                        ).decode()


def rejected(app: GatewayApp) -> float:
    """llmesh_config_rejected_total of the gateway, as its /metrics serves it."""
    return app.registry.get_sample_value("llmesh_config_rejected_total", {"service": "gateway"}) or 0


async def apply(app: GatewayApp, path, text: str) -> bool:
    """Writes the config; True once it is in force, False once it was rejected."""
    before, revision = rejected(app), write_config_file(path, text)
    assert await asyncio.to_thread(wait_until, lambda: app.config.revision == revision or rejected(app) > before, 10)
    return app.config.revision == revision


async def ask(app: GatewayApp, provider: Provider) -> str:
    text = ""
    async for item in app.providers.generate(provider, "remote", completion_request("hosted", "hi", timeout_s=10), 10):
        if isinstance(item, Delta):
            text += item.text
    return text


async def test_a_config_pointing_the_key_at_the_mesh_ca_key_is_refused_and_the_key_never_sent(gateway,
                                                                                              fake_provider):
    app, path, tls = gateway
    fake, base_url = fake_provider
    assert await apply(app, path, _doc(base_url, api_key_file="openai"))
    assert await ask(app, app.config.current.providers["hosted"]) == "ok"
    good = app.config.revision
    for steered in (_doc(base_url, api_key_file=str(tls / "ca-key.pem")),
                    _doc(base_url, api_key_file="../tls/ca-key.pem"),
                    _doc(base_url, api_key_env="LLMESH_CONSUL_TOKEN"),
                    _doc("http://api.example.com/v1", api_key_file="openai")):
        assert not await apply(app, path, steered)
        assert app.config.revision == good
        assert await ask(app, app.config.current.providers["hosted"]) == "ok"
    assert rejected(app) == 4
    assert fake.authorizations == ["Bearer sk-good"] * 5
    assert await apply(app, path, _doc(base_url, api_key_env="OPENAI_API_KEY"))  # on the allow-list
    assert await ask(app, app.config.current.providers["hosted"]) == "ok"
    assert fake.authorizations[-1] == "Bearer sk-env"


async def test_a_provider_past_the_config_is_refused_before_anything_is_sent(gateway, fake_provider):
    """As if a config had been applied around the checks: at call time the key source and the URL
    are checked again, and nothing reaches the provider."""
    app, _, tls = gateway
    fake, base_url = fake_provider
    (tls.parent / "provider-keys" / "escape").symlink_to(tls / "ca-key.pem")
    for provider, reason in (
            (Provider.model_construct(base_url=base_url, models={}, api_key_file=str(tls / "ca-key.pem"),
                                      api_key_env=None), "provider_key_refused"),
            (Provider.model_construct(base_url=base_url, models={}, api_key_file="escape", api_key_env=None),
             "provider_key_refused"),
            (Provider.model_construct(base_url=base_url, models={}, api_key_file=None,
                                      api_key_env="LLMESH_CONSUL_TOKEN"), "provider_key_refused")):
        with pytest.raises(Unavailable) as info:
            await ask(app, provider)
        assert info.value.reason == reason and "MESH-CA" not in info.value.message
    assert fake.authorizations == []


async def test_plain_http_off_loopback_is_never_called(gateway, fake_provider):
    """The fake provider doubles as an HTTP proxy: a call to an http:// host off loopback would
    reach it; none does."""
    app, _, _ = gateway
    fake, base_url = fake_provider
    app.providers._proxies = {"http": base_url.removesuffix("/v1")}
    far = Provider.model_construct(base_url="http://api.example.com/v1", models={}, api_key_file="openai",
                                   api_key_env=None)
    with pytest.raises(Unavailable) as info:
        await ask(app, far)
    assert info.value.reason == "provider_url_refused"
    assert fake.authorizations == []

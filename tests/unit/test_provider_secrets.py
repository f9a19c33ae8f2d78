"""Secrets a config writer cannot steer: a provider's base_url is https (plain http only to a
loopback host), its key file comes only from the gateway's key directory (resolved: symlinks and
``..`` cannot leave it; never a directory of the mesh's own secrets), its key variable only from
the allow-list. A live config that breaks them is refused as a whole; the last good one stays."""

from __future__ import annotations

import os

import pytest
from prometheus_client import CollectorRegistry

from llmesh.errors import Unavailable
from llmesh.liveconfig.document import InvalidConfig, parse
from llmesh.liveconfig.live import LiveConfig
from llmesh.liveconfig.schema import MeshConfig, Provider, url_problem
from llmesh.liveconfig.stores import Version
from llmesh.gateway.upstream.provider_secrets import KeyRefused, ProviderSecrets

URL = "https://provider.example/v1"


@pytest.mark.parametrize("url", ["https://api.openai.com/v1", "https://10.0.0.5:8443/v1", "http://127.0.0.1:9/v1",
                                 "http://127.8.0.1/v1", "http://localhost:8000/v1", "http://[::1]:8000/v1",
                                 "HTTPS://API.example.com/v1"])
def test_https_anywhere_and_http_only_to_loopback(url):
    assert url_problem(url) is None
    Provider(base_url=url, models={})


@pytest.mark.parametrize("url, says", [
    ("http://api.example.com/v1", "https://"), ("http://10.0.0.5/v1", "loopback"),
    ("http://localhost.attacker.example/v1", "loopback"), ("http://127.0.0.1.nip.io/v1", "loopback"),
    ("ftp://127.0.0.1/v1", "https://"), ("file:///etc/passwd", "no host"), ("api.openai.com/v1", "no host"),
    ("https://user:pw@api.example.com/v1", "password"), ("https://[::1/v1", "not a URL")])
def test_other_urls_are_refused_by_the_schema(url, says):
    assert says in (url_problem(url) or "")
    with pytest.raises(InvalidConfig, match="providers.p: Value error, base_url"):
        parse(f'{{"providers": {{"p": {{"base_url": "{url}", "models": {{}}}}}}}}')


@pytest.fixture
def layout(tmp_path):
    """A key directory with one key, and the mesh's certificate directory beside it
    (the CA key in it is no setting of anyone's; its certificate is)."""
    keys, tls = tmp_path / "provider-keys", tmp_path / "tls"
    keys.mkdir()
    tls.mkdir()
    (keys / "openai").write_text("sk-good\n")
    (tls / "ca.pem").write_text("CERT")
    (tls / "ca-key.pem").write_text("-----BEGIN PRIVATE KEY-----\nMESH-CA\n-----END PRIVATE KEY-----\n")
    return keys, tls


def test_key_files_only_from_the_key_directory(layout):
    keys, tls = layout
    secrets = ProviderSecrets.of(keys, [], mesh_files=[tls / "ca.pem"])
    assert secrets.key_path("openai") == (keys / "openai").resolve()
    assert secrets.key_path(str(keys / "openai")) == (keys / "openai").resolve()
    for outside in (str(tls / "ca-key.pem"), "../tls/ca-key.pem", "sub/../../tls/ca-key.pem", "/etc/passwd"):
        with pytest.raises(KeyRefused, match="outside the provider key directory"):
            secrets.key_path(outside)
    (keys / "escape").symlink_to(tls / "ca-key.pem")  # a symlink in the directory is followed, then judged
    (keys / "inner").symlink_to(keys / "openai")
    with pytest.raises(KeyRefused, match="outside"):
        secrets.key_path("escape")
    assert secrets.key_path("inner") == (keys / "openai").resolve()
    with pytest.raises(KeyRefused, match="no provider key directory"):
        ProviderSecrets().key_path("openai")


def test_never_a_directory_of_the_mesh_own_secrets_even_inside_the_key_directory(layout):
    keys, _ = layout
    (keys / "mesh").mkdir()
    (keys / "mesh" / "ca-key.pem").write_text("MESH-CA")
    secrets = ProviderSecrets.of(keys, [], mesh_files=[keys / "mesh" / "ca.pem", None])
    with pytest.raises(KeyRefused, match="a directory of the mesh's own secrets"):
        secrets.key_path("mesh/ca-key.pem")
    assert secrets.key_path("openai")


def test_a_rotated_secret_mount_stays_closed(tmp_path):
    """A Kubernetes Secret volume: each file is a symlink through ``..data`` into a timestamped
    directory that a rotation replaces. The mount directory itself stays closed."""
    mount = tmp_path / "etc" / "tls"
    (mount / "..2024_01").mkdir(parents=True)
    (mount / "..2024_01" / "ca.crt").write_text("CERT")
    (mount / "..data").symlink_to("..2024_01")
    (mount / "ca.crt").symlink_to("..data/ca.crt")
    secrets = ProviderSecrets.of(tmp_path, [], mesh_files=[mount / "ca.crt"])
    (mount / "..2024_02").mkdir()  # the rotation: a new directory, ..data re-pointed
    (mount / "..2024_02" / "ca.key").write_text("MESH-CA")
    (mount / "..data").unlink()
    (mount / "..data").symlink_to("..2024_02")
    for path in ("etc/tls/..data/ca.key", "etc/tls/..2024_02/ca.key"):
        with pytest.raises(KeyRefused, match="a directory of the mesh's own secrets"):
            secrets.key_path(path)


def test_key_variables_only_from_the_allow_list(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("LLMESH_REDIS_URL", "redis://:hunter2@redis:6379")
    secrets = ProviderSecrets.of(None, ["OPENAI_API_KEY"])
    assert secrets.api_key(Provider(base_url=URL, models={}, api_key_env="OPENAI_API_KEY")) == "sk-env"
    with pytest.raises(Unavailable) as info:
        secrets.api_key(Provider(base_url=URL, models={}, api_key_env="LLMESH_REDIS_URL"))
    assert info.value.reason == "provider_key_refused" and "hunter2" not in info.value.message
    with pytest.raises(Unavailable, match="refused by the gateway"):
        ProviderSecrets().api_key(Provider(base_url=URL, models={}, api_key_env="OPENAI_API_KEY"))


def test_at_call_time_a_key_file_that_became_a_symlink_out_is_not_read(layout, caplog):
    keys, tls = layout
    secrets = ProviderSecrets.of(keys, [], mesh_files=[tls / "ca.pem"])
    p = Provider(base_url=URL, models={}, api_key_file="openai")
    secrets.check(MeshConfig(providers={"p": p}))  # applied while the file was the key
    assert secrets.api_key(p) == "sk-good"
    (keys / "openai").unlink()
    (keys / "openai").symlink_to(tls / "ca-key.pem")
    with pytest.raises(Unavailable) as info:
        secrets.api_key(p)
    assert info.value.reason == "provider_key_refused" and "MESH-CA" not in info.value.message
    (keys / "openai").unlink()
    os.mkfifo(keys / "openai")  # not a regular file: never read (nor waited on)
    with pytest.raises(Unavailable) as info:
        secrets.api_key(p)
    assert info.value.reason == "provider_key_refused"
    assert "not a regular file" in caplog.records[-1].reason and str(keys) not in info.value.message


def _doc(key_file: str, env: str | None = None) -> str:
    extra = f', "api_key_env": "{env}"' if env else ""
    return (f'{{"providers": {{"hosted": {{"base_url": "{URL}", "api_key_file": "{key_file}"{extra}, '
            f'"models": {{"m": "their-m"}}}}}}}}')


def test_a_live_config_naming_other_secrets_is_refused_and_the_last_good_one_stays(layout):
    keys, tls = layout
    metrics = CollectorRegistry()
    live = LiveConfig(None, metrics, "gateway")
    live.add_check(ProviderSecrets.of(keys, ["OPENAI_API_KEY"], mesh_files=[tls / "ca.pem"]).check)
    assert live.offer(Version(1, _doc("openai")))
    assert not live.offer(Version(2, _doc(str(tls / "ca-key.pem"))))
    assert not live.offer(Version(3, _doc("openai", env="LLMESH_CONSUL_TOKEN")))
    assert live.revision == 1 and live.current.providers["hosted"].api_key_file == "openai"
    assert metrics.get_sample_value("llmesh_config_rejected_total", {"service": "gateway"}) == 2
    assert metrics.get_sample_value("llmesh_config_revision", {"service": "gateway"}) == 1
    with pytest.raises(InvalidConfig, match=r"providers.hosted: api_key_file .* is outside .*; "
                                            r"providers.hosted: api_key_env 'X' is not in"):
        ProviderSecrets.of(keys, []).check(parse(_doc("../x", env="X")))


def test_a_config_in_force_before_the_check_came_is_refused_for_the_defaults(layout, caplog):
    """The runner applies the first document before the app (and its checks) is built."""
    keys, tls = layout
    metrics = CollectorRegistry()
    live = LiveConfig(None, metrics, "gateway")
    assert live.offer(Version(7, _doc(str(tls / "ca-key.pem"))))
    live.add_check(ProviderSecrets.of(keys, [], mesh_files=[tls / "ca.pem"]).check)
    assert live.revision == 0 and live.current == MeshConfig()
    assert metrics.get_sample_value("llmesh_config_rejected_total", {"service": "gateway"}) == 1
    assert metrics.get_sample_value("llmesh_config_revision", {"service": "gateway"}) == 0
    refused = [r for r in caplog.records if r.getMessage() == "config rejected; keeping the last good one"]
    assert refused and refused[-1].revision == 7 and "outside the provider key directory" in refused[-1].reason
    assert live.offer(Version(8, _doc("openai"))) and live.revision == 8

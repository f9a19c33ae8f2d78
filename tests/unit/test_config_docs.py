"""docs/configuration.md is generated from the settings classes and the live-config schema
(scripts/gen_config_docs.py); `make docs-check` fails when a setting changes without it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmesh.gateway.config import GatewaySettings
from llmesh.liveconfig.schema import MeshConfig
from llmesh.settings import MeshSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_committed_reference_matches_the_settings_classes(gen):
    assert not gen.stale(ROOT / "docs" / "configuration.md", gen.reference())


def test_a_setting_added_without_regenerating_fails_the_check(gen, tmp_path, capsys, monkeypatch):
    class Widened(GatewaySettings):
        model_config = SettingsConfigDict(env_prefix="LLMESH_GATEWAY_", extra="ignore", frozen=True)
        brand_new_knob_s: float = Field(default=2.5, gt=0, description="a setting nobody documented yet")

    doc = tmp_path / "configuration.md"
    doc.write_text(gen.reference())
    assert gen.main(["--check", str(doc)]) == 0

    monkeypatch.setattr(gen, "SETTINGS", tuple((t, Widened if t == "gateway" else p) for t, p in gen.SETTINGS))
    assert gen.main(["--check", str(doc)]) == 1
    err = capsys.readouterr().err
    assert "docs/configuration.md is stale: run make docs" in err
    assert "+| <a id=\"llmesh_gateway_brand_new_knob_s\"></a>`LLMESH_GATEWAY_BRAND_NEW_KNOB_S` | float, > 0 | `2.5` " \
           "| a setting nobody documented yet |" in err

    assert gen.main(["--write", str(doc)]) == 0
    assert gen.main(["--check", str(doc)]) == 0


def test_env_names_types_and_defaults_are_pydantic_settings_own(gen):
    rows = {r.anchor: r for r in gen.settings_rows(MeshSettings, set())}
    assert rows["llmesh_discovery"].name == "`LLMESH_DISCOVERY`"
    assert rows["llmesh_discovery"].type == "one of `static`, `etcd`, `consul`"
    assert rows["llmesh_registry_ttl_s"].type == "int, ≥ 1"
    assert rows["llmesh_redis_url"].default == "unset"
    assert rows["llmesh_trust"].default == "`local`"
    assert rows["llmesh_trust"].type == "one of `local`, `token`, `tls`"
    gateway = {r.anchor: r for r in gen.settings_rows(GatewaySettings, set())}
    assert gateway["llmesh_gateway_require_auth"].default == "`false`"  # a bool (was LLMESH_LOCAL_TRUST's)
    assert gateway["llmesh_gateway_port"].default == "`50051`"  # ServiceSettings' field, the service's prefix
    assert gateway["llmesh_gateway_workers"].type == "int, ≥ 1, ≤ 256"


def test_a_live_config_field_added_shows_in_its_section(gen):
    class Wider(MeshConfig):
        brand_new_section: dict[str, int] = Field(default={}, description="per model, a number")

    text = gen.render([], Wider)
    assert "| `brand_new_section` | map of int | `{}` | per model, a number |" in text
    assert text != gen.render([], MeshConfig)


def test_a_description_note_that_matches_no_field_is_an_error(gen, monkeypatch):
    monkeypatch.setitem(gen.DESCRIPTIONS, "GatewaySettings.gone_setting", "a setting that was removed")
    with pytest.raises(SystemExit, match="gone_setting"):
        gen.reference()

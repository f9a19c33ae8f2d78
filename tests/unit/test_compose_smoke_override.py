"""The compose smoke's override (tests/compose_smoke/prepare.py) only swaps what cannot be pulled:
checked on the real compose.yaml with Docker's answers replaced (no Docker here); the smoke itself
runs the result (make compose-smoke)."""

from __future__ import annotations

import pytest
import yaml

from tests.compose_smoke import prepare

COMPOSE = yaml.safe_load((prepare.COMPOSE_DIR / "compose.yaml").read_text())


def _plan(monkeypatch, reachable: set[str]) -> prepare.Plan:
    """plan() with `reachable` the images a registry serves; building images is recorded, not run."""
    monkeypatch.setattr(prepare, "pullable", lambda image: image in reachable)
    monkeypatch.setattr(prepare, "local_base_image", lambda: prepare.LOCAL_BASE)
    monkeypatch.setattr(prepare, "stand_in_image", lambda target, base: f"llmesh-smoke/{target}:bookworm")
    return prepare.plan(COMPOSE)


def test_no_registry_swaps_images_leaves_out_consul_grafana_jaeger_and_changes_nothing_else(monkeypatch):
    p = _plan(monkeypatch, reachable=set())
    over = p.override(COMPOSE)["services"]
    assert set(over) <= set(COMPOSE["services"])
    for name, entry in over.items():
        assert set(entry) <= {"build", "image", "scale", "environment"}, name
        if "build" in entry:
            assert set(entry["build"]) == {"network", "args"} and entry["build"]["network"] == "host"
            assert "build" in COMPOSE["services"][name]
    assert {n: over[n]["image"] for n in ("redis", "etcd", "prometheus")} == {
        "redis": "llmesh-smoke/redis:bookworm", "etcd": "llmesh-smoke/etcd:bookworm",
        "prometheus": "llmesh-smoke/prometheus:bookworm"}
    assert {n for n, e in over.items() if e.get("scale") == 0} == {"consul", "consul-acl", "grafana", "jaeger"}
    envs = {n: e["environment"] for n, e in over.items() if "environment" in e}
    assert set(envs) == set(prepare.LLMESH_SERVICES)
    assert all(env == {"LLMESH_DISCOVERY": "etcd", "OTEL_TRACES_EXPORTER": "none"} for env in envs.values())
    assert p.build_args == {"PYTHON_IMAGE": prepare.LOCAL_BASE}
    # every swap is said out loud
    assert sum("left out" in n for n in p.notes) == 4 and any("discovery: etcd" in n for n in p.notes)


def test_everything_pullable_changes_nothing(monkeypatch):
    images = {svc["image"] for svc in COMPOSE["services"].values() if "image" in svc}
    p = _plan(monkeypatch, reachable=images | {prepare.UPSTREAM_BASE})
    assert p.override(COMPOSE) == {"services": {}}
    assert not p.build_args and not p.left_out and not p.env


@pytest.mark.parametrize("reachable", ["hashicorp/consul:1.20", "jaegertracing/all-in-one:1.62.0"])
def test_a_pullable_consul_or_jaeger_is_kept(monkeypatch, reachable):
    p = _plan(monkeypatch, reachable={reachable})
    kept = [n for n, s in COMPOSE["services"].items() if s.get("image") == reachable]
    assert kept and not set(kept) & set(p.left_out)
    if reachable.startswith("hashicorp/consul"):
        assert "LLMESH_DISCOVERY" not in p.env
    else:
        assert "OTEL_TRACES_EXPORTER" not in p.env

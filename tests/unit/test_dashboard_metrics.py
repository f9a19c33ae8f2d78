"""Every llmesh metric the Grafana dashboard and the Prometheus rules query is one the code
declares (a Counter, Gauge, Histogram or Summary of that name in services/ or libs/, read as
Prometheus exposes it: ``_total`` on counters, ``_bucket``/``_count``/``_sum`` on histograms),
and every recording rule they read (``llmesh:...``) is recorded in the rules file. A panel over a
misspelt or removed metric shows nothing without failing anywhere else."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "llmesh-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "llmesh-rules.yml"
DECLARED = re.compile(r'\b(?:Counter|Gauge|Histogram|Summary)\(\s*"(llmesh_[a-z0-9_]+)"')
USED = re.compile(r"\b(llmesh_[a-z0-9_]+|llmesh:[a-z0-9_:]+)")
SUFFIXES = ("", "_total", "_bucket", "_count", "_sum")


def declared() -> set[str]:
    names: set[str] = set()
    for folder in ("services", "libs"):
        for path in (ROOT / folder).rglob("*.py"):
            names.update(DECLARED.findall(path.read_text()))
    return names


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]] + [r["expr"] for r in rules()]


def test_every_queried_metric_is_declared_and_every_recording_rule_recorded():
    metrics, recorded = declared(), {r["record"] for r in rules() if "record" in r}
    assert {"llmesh_requests", "llmesh_flow_queued", "llmesh_degraded_requests"} <= metrics  # the scan finds them
    missing = set()
    for expr in queries():
        for name in USED.findall(expr):
            if ":" in name:
                ok = name in recorded
            else:
                ok = any(name.endswith(suffix) and name[:len(name) - len(suffix)] in metrics for suffix in SUFFIXES)
            if not ok:
                missing.add(name)
    assert not missing, f"queried but never declared or recorded: {sorted(missing)}"


def test_the_overload_panels_and_alert_are_there():
    used = {name for expr in queries() for name in USED.findall(expr)}
    assert {"llmesh_flow_queued", "llmesh_flow_wait_seconds_bucket", "llmesh_flow_refusals_total",
            "llmesh_flow_tenant_weight", "llmesh_degraded_requests_total"} <= used
    alerts = {r["alert"]: r for r in rules() if "alert" in r}
    assert "llmesh:degraded_ratio:rate10m" in alerts["LlmeshDegradedAnswers"]["expr"]

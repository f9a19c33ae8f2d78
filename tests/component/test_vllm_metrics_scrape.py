"""llmesh's vLLM-named metrics against a real vLLM's /metrics: vLLM's own OpenAI server (vLLM's
CPU build, .venv-vllm) on SmolLM2 fp32, asked a few chat completions with the official `openai`
client, then scraped. Run with .venv-vllm's interpreter (the Makefile's VLLM_TESTS).

- every `vllm:` family the engine exports (tests/unit/test_engine_metrics_vllm.py: ``engine_families``) is on
  the real page with the same type, label names and help, and the engine's label values are the
  kind vLLM writes (``engine="0"``, ``model_name`` the served name);
- tests/data/vllm-0.32.0-metrics.json is this scrape (``scripts/vllm-metrics-scrape`` writes it);
- every vLLM series a PromQL expression of the Grafana dashboard or the Prometheus rules reads,
  and every `vllm:` name the docs, the README and the code use, is on the page; the labels those
  expressions group or match by are labels of the series."""

from __future__ import annotations

import re

import pytest

from tests.unit.test_engine_metrics_vllm import PIN, engine_families
from tests.vllm_metrics import (ROOT, families_from_text, label_problems, metric_problems, pinned_metrics,
                                promql_expressions, scrape_real_vllm, series_names, vllm_names_in)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    from tests.component.vllm_faults import require_vllm

    require_vllm()
    return scrape_real_vllm(tmp_path_factory.mktemp("vllm-server"))


def test_the_engines_vllm_families_are_on_the_real_page(page):
    real = families_from_text(page)
    mine = {name: family for name, family in engine_families().items() if name.startswith("vllm:")}
    assert len(mine) >= 14
    assert metric_problems(mine, real) == []
    # the label values: vLLM's single engine core is engine "0", model_name the served name
    engines = {labels["engine"] for name, labels in series_names(page).items() if name.startswith("vllm:")
               for labels in labels if "engine" in labels}
    models = {labels["model_name"] for name, labels in series_names(page).items() if name.startswith("vllm:")
              for labels in labels if "model_name" in labels}
    assert engines == {"0"} and models == {"smollm2-vllm"}


def test_the_pinned_list_is_this_scrape(page):
    real = {name: family for name, family in families_from_text(page).items() if name.startswith("vllm:")}
    assert pinned_metrics(PIN) == real, "regenerate it: .venv-vllm/bin/python scripts/vllm-metrics-scrape"


def test_dashboard_and_rules_query_series_on_the_real_page(page):
    series = series_names(page)
    exprs = promql_expressions()
    assert any(path.startswith("deploy/grafana") for path, _ in exprs)
    assert any(path.startswith("deploy/prometheus") for path, _ in exprs)
    vllm_exprs = [(path, expr) for path, expr in exprs if "vllm:" in expr]
    assert len(vllm_exprs) >= 7
    missing = sorted({(path, name) for path, expr in vllm_exprs for name in re.findall(r"vllm:[a-z_:]+", expr)
                      if name not in series})
    assert missing == [], "series the real vLLM page does not have"
    assert sorted(p for path, expr in vllm_exprs for p in label_problems(expr, series)) == []


def test_docs_readme_and_code_name_only_what_the_real_page_has(page):
    families, series = families_from_text(page), series_names(page)
    named = vllm_names_in([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                           ROOT / "libs" / "llmesh" / "cli" / "status.py"])
    assert any(path.startswith("docs/") for path, _ in named)
    assert sorted((path, name) for path, name in named if name not in series and name not in families) == []


def test_the_check_refuses_what_vllm_032_does_not_export(page):
    series = series_names(page)
    # vLLM's v0 names, and a label the series do not carry
    assert "vllm:gpu_cache_usage_perc" not in series and "vllm:time_per_output_token_seconds_bucket" not in series
    assert label_problems("sum by (model) (vllm:num_requests_running)", series) == [
        "sum by (model) (vllm:num_requests_running): vllm:num_requests_running has no label 'model'"]
    assert label_problems('vllm:kv_cache_usage_perc{engine="0", model_name=~".+"}', series) == []

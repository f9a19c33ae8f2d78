"""The dashboard's fairness panel ("served-token share per tenant against its weight's share,
tenants waiting") computed by a real Prometheus over series a test exporter serves: both shares
are among the tenants that have requests waiting, so a tenant served while nothing of its waits
(it is not contending) takes no share from the ones that are."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from llmesh.testing import wait_until
from tests.prometheus_server import PrometheusServer

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "llmesh-dashboard.json"
TITLE = "Served-token share per tenant against its weight's share (tenants waiting)"
# tokens per second (prompt, generation), requests waiting per class, weight: c is served but waits for nothing
TENANTS = {"a": ((20, 10), {"standard": 1, "batch": 1}, 3), "b": ((5, 5), {"standard": 1}, 1),
           "c": ((50, 10), {"standard": 0}, 5)}


def exposition(elapsed_s: float) -> str:
    lines = []
    for tenant, ((prompt, generated), queued, weight) in TENANTS.items():
        lines.append(f'llmesh_prompt_tokens_total{{model="m",tenant="{tenant}"}} {prompt * elapsed_s}')
        lines.append(f'llmesh_generation_tokens_total{{model="m",tenant="{tenant}"}} {generated * elapsed_s}')
        lines += [f'llmesh_flow_queued{{model="m",tenant="{tenant}",class="{c}"}} {n}' for c, n in queued.items()]
        lines.append(f'llmesh_flow_tenant_weight{{tenant="{tenant}"}} {weight}')
    return "\n".join(lines) + "\n"


def test_the_served_and_weight_shares_count_only_the_tenants_waiting(tmp_path):
    started = time.monotonic()

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            body = exposition(time.monotonic() - started).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    exporter = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=exporter.serve_forever, daemon=True).start()
    prometheus = PrometheusServer(tmp_path / "prom", {"exporter": f"127.0.0.1:{exporter.server_address[1]}"})
    try:
        prometheus.start()
        panel = next(p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == TITLE)
        served, weight = (t["expr"].replace("$__rate_interval", "1m") for t in panel["targets"])

        def shares(expr: str) -> dict[str, float]:
            return {r["metric"]["tenant"]: float(r["value"][1]) for r in prometheus.query(expr)}

        assert wait_until(lambda: len(shares(served)) == 2, 20), shares(served)
        for got in (shares(served), shares(weight)):
            assert set(got) == {"a", "b"}  # c waits for nothing
            assert abs(got["a"] - 0.75) < 1e-6 and abs(got["b"] - 0.25) < 1e-6, got
    finally:
        prometheus.stop()
        exporter.shutdown()
        exporter.server_close()

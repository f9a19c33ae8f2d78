"""The Prometheus rules in deploy/ are valid for the Prometheus that ships here."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "llmesh-rules.yml"


def test_promtool_accepts_the_rules():
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed: apt-get install prometheus (.ci/run does)")
    out = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout and "rules found" in out.stdout


DEGRADED = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # 10 answers a second for 'big'; 1 a second of them capped and sent to the variant (two policies)
      - series: 'llmesh_requests_total{{model="big",tenant="t",status="ok"}}'
        values: '0+600x60'
      - series: 'llmesh_degraded_requests_total{{model="big",class="standard",policy="max_tokens"}}'
        values: '0+60x60'
      - series: 'llmesh_degraded_requests_total{{model="big",class="standard",policy="variant"}}'
        values: '0+60x60'
      # 'small' answers without degradation: no alert from it alone
      - series: 'llmesh_requests_total{{model="small",tenant="t",status="ok"}}'
        values: '0+60x60'
    promql_expr_test:
      - expr: llmesh:degraded_ratio:rate10m
        eval_time: 30m
        exp_samples:
          - labels: 'llmesh:degraded_ratio:rate10m'
            value: {ratio}
    alert_rule_test:
      - eval_time: 10m
        alertname: LlmeshDegradedAnswers
        exp_alerts: []
      - eval_time: 40m
        alertname: LlmeshDegradedAnswers
        exp_alerts:
          - exp_labels: {{severity: ticket}}
            exp_annotations: {annotations}
"""


def test_the_degraded_answers_alert_fires_past_five_percent_for_fifteen_minutes(tmp_path):
    """promtool's rule unit test: 60 degraded requests a minute (each with two policies) over 660
    answers a minute is 1/11 of answers, counted once per request; the alert is pending at 10
    minutes and firing at 40."""
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed: apt-get install prometheus (.ci/run does)")
    spec = tmp_path / "degraded.test.yml"
    alert = next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
                 if r.get("alert") == "LlmeshDegradedAnswers")
    annotations = {k: v.replace("{{ $value | humanizePercentage }}", "9.091%") for k, v in alert["annotations"].items()}
    assert "9.091% of answers" in annotations["description"]
    spec.write_text(DEGRADED.format(rules=RULES, ratio=1 / 11, annotations=json.dumps(annotations)))
    out = subprocess.run(["promtool", "test", "rules", str(spec)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


LEDGER = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # a gateway whose Redis is gone: a failed round every 2 s
      - series: 'llmesh_ledger_share_failures_total{{instance="gw-a:9100",job="gateway"}}'
        values: '0+30x60'
      # one that failed once (a blip) and shares again: no alert
      - series: 'llmesh_ledger_share_failures_total{{instance="gw-b:9100",job="gateway"}}'
        values: '0 1+0x60'
    alert_rule_test:
      - eval_time: 8m
        alertname: LlmeshLedgerNotShared
        exp_alerts: []
      - eval_time: 20m
        alertname: LlmeshLedgerNotShared
        exp_alerts:
          - exp_labels: {{severity: ticket, instance: "gw-a:9100"}}
            exp_annotations: {annotations}
"""


def test_the_ledger_alert_fires_on_a_gateway_that_keeps_failing_to_share_not_on_a_blip(tmp_path):
    """promtool's rule unit test: one gateway failing a round every 2 s fires after 10 minutes of
    failures within 5 minutes; one that failed once does not."""
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed: apt-get install prometheus (.ci/run does)")
    alert = next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
                 if r.get("alert") == "LlmeshLedgerNotShared")
    annotations = {k: v.replace("{{ $labels.instance }}", "gw-a:9100").replace("{{ $value }}", "150")
                   for k, v in alert["annotations"].items()}
    spec = tmp_path / "ledger.test.yml"
    spec.write_text(LEDGER.format(rules=RULES, annotations=json.dumps(annotations)))
    out = subprocess.run(["promtool", "test", "rules", str(spec)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout

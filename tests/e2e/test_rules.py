"""The Prometheus rules in deploy/ are valid for the Prometheus that ships here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "llmesh-rules.yml"


def test_promtool_accepts_the_rules():
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed: apt-get install prometheus (.ci/run does)")
    out = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout and "rules found" in out.stdout

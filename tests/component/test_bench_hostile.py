"""`python -m bench.hostile` runs against its own mesh and prints its summary (two small classes:
this checks the bench, not the figures)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_hostile_bench_prints_its_summary():
    done = subprocess.run([sys.executable, "-m", "bench.hostile", "--json", "--max-bytes", "20000", "--baseline-s", "1",
                           "--only", "pii_digits", "--only", "long_headers"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["five_xx"] == 0 and report["failed_victims"] == 0
    assert set(report["classes"]) == {"pii_digits", "long_headers"}
    digits = report["classes"]["pii_digits"]
    assert digits["cases"] == sum(digits["statuses"].values()) == 17  # 4 sizes x 4 variants, and the largest
    assert digits["worst_s"] > 0 and digits["peak_rss_mib"] > 0 and "stalls_over_50ms" in digits["loop"]
    assert report["baseline"]["victim_requests"] > 0 and report["attack"]["victim_p99_ratio"] > 0

"""`llmesh bench guards` runs and prints its JSON (tiny rounds: this checks the verb, not the figures)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_guards_bench_prints_every_figure():
    done = subprocess.run([sys.executable, "-m", "llmesh", "bench", "guards", "--rounds", "1", "--seconds", "0.01",
                           "--audit-records", "160"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["pii"]["mask_en_pii"]["masked"] == 10 and report["pii"]["mask_en_clean"]["masked"] == 0
    assert report["pii"]["mask_zh_pii"]["masked"] == 10
    assert report["injection"]["en_attack"]["action"] == "block"
    assert report["injection"]["en_benign"]["action"] == "allow"
    for entry in (*report["pii"].values(), *report["injection"].values()):
        assert entry["cpu_us"] > 0 and entry["mb_per_cpu_s"] > 0
    assert report["audit"]["fsync_false"]["records"] == 160
    assert report["audit"]["asyncio_8_tasks_appending"]["records"] == 160

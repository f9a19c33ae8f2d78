"""``python -m bench.routing_replicas --quick --json``: real sim meshes with a Redis, driven through
the HTTP front by the official client with an API key, behind a gateway of 1 and of 3 worker
processes (one of them SIGKILLed halfway in the third run, their in-flight load not shared in the
fourth): each run served conversations and read
the engines' prefix-cache hit rate, the killed worker came back, and the JSON's ratios and goal
follow from its runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_compares_three_workers_and_a_kill_with_one():
    done = subprocess.run([sys.executable, "-m", "bench.routing_replicas", "--quick", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["bench"] == "routing_replicas" and out["goal"] == 0.95
    runs = out["runs"]
    assert [(n, r["workers"], r["killed_worker"], r["load_shared"]) for n, r in runs.items()] == [
        ("one", 1, False, True), ("three", 3, False, True), ("three_one_killed", 3, True, True),
        ("three_unshared", 3, False, False)]
    for run in runs.values():
        assert run["requests"] > 0 and run["follow_ups"] > 0
        assert 0 < run["kv_hit_rate"] <= 1  # shared system prompts: follow-ups and repeats hit
        assert 0 <= run["follow_ups_on_prefix_engine"] <= run["follow_ups"]
    assert runs["three"]["client_errors"] == runs["one"]["client_errors"] == 0
    assert runs["three_one_killed"]["killed_worker_restarted"]
    assert list(runs["one"]["turns_per_worker"]) == ["0"]
    assert len(runs["three"]["turns_per_worker"]) > 1  # the client's connections reached several workers
    ratios = out["hit_rate_vs_one"]
    assert ratios == {n: round(runs[n]["kv_hit_rate"] / runs["one"]["kv_hit_rate"], 3)
                      for n in ("three", "three_one_killed")}
    assert out["goal_met"] == all(x >= 0.95 for x in ratios.values())
    sticky = out["follow_ups_on_prefix_engine_vs_one"]
    assert list(sticky) == ["three", "three_one_killed", "three_unshared"]
    assert all(sticky[n] == round(runs[n]["follow_up_prefix_hit_rate"] / runs["one"]["follow_up_prefix_hit_rate"], 3)
               for n in sticky)

"""``python -m bench.routing_gateway --quick --json``: a real sim mesh driven through the HTTP
front; the JSON has its shape, every idle follow-up landed on the engine that served its first
turn (the access log says so) and started faster than the uncached first turn, the capacity's closed
loops kept their users busy, and both policies ran at the planned share of the best one's turns a
second."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_reports_follow_ups_on_their_prefix_engine():
    done = subprocess.run([sys.executable, "-m", "bench.routing_gateway", "--quick", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["bench"] == "routing_gateway" and out["goal"] == 1.3
    lone = out["lone"]
    assert lone["follow_ups"] == lone["reps"] == 2
    assert lone["follow_ups_on_prefix_engine"] == lone["follow_ups"]
    assert lone["cached_follow_up_ttft_ms_p50"] < lone["uncached_first_ttft_ms_p50"]
    idle_split = out["lone_follow_up_mean_ttft_split"]
    assert idle_split["engine_requests"] == lone["follow_ups"] and idle_split["engine_ms"] > 0
    capacity = out["capacity"]
    assert [r["users"] for r in capacity["runs"]] == [2, 4]  # half and all of the quick fleet's 4 slots
    assert capacity["turns_per_s"] == max(r["turns_per_s"] for r in capacity["runs"]) > 0
    assert capacity["users"] in (2, 4) and not any("rate_turns_per_s" in r for r in capacity["runs"])
    assert capacity["runs"][-1]["load"]["client_in_flight_share"] > 0.8  # a closed loop keeps its users busy
    assert set(out["loaded"]) == {"prefix_aware", "round_robin"}
    for policy, run in out["loaded"].items():
        assert run["policy"] == policy and run["first_turns"] > 0 and run["follow_ups"] > 0
        assert 0 <= run["follow_ups_on_prefix_engine"] <= run["follow_ups"]
        assert run["follow_up_ttft_ms"]["p50"] <= run["follow_up_ttft_ms"]["p99"]
        assert run["load"]["samples"] > 0 and run["load"]["client_in_flight_share"] > 0
        assert run["rate_turns_per_s"] == round(0.8 * capacity["turns_per_s"], 2) and run["starts"] > 0
        assert 0.3 < out["load_share"][policy] == round(run["turns_per_s"] / capacity["turns_per_s"], 3) < 1.2
        split = run["mean_ttft_split"]  # the engines counted every turn; each view holds the next
        assert split["engine_requests"] == run["first_turns"] + run["follow_ups"]
        assert split["client_ms"] > split["gateway_ms"] > split["engine_ms"] > 0
        assert run["cpu"]["mesh_cores"] >= run["cpu"]["gateway_cores"] > 0
    # prefix_aware keeps a conversation on one engine far more often than round robin's rotation
    pa, rr = out["loaded"]["prefix_aware"], out["loaded"]["round_robin"]
    assert pa["follow_up_prefix_hit_rate"] > rr["follow_up_prefix_hit_rate"]
    assert out["ratio"] == round(pa["follow_up_ttft_ms"]["p50"] / lone["cached_follow_up_ttft_ms_p50"], 2)
    assert out["goal_met"] == (out["ratio"] <= 1.3)
    closed = out["closed_loop"]  # the same check under a closed loop, users for 80 % of capacity
    assert 1 <= closed["users"] <= 4 and set(closed["loaded"]) == {"prefix_aware", "round_robin"}
    for policy, run in closed["loaded"].items():
        assert run["users"] == closed["users"] and "rate_turns_per_s" not in run and run["follow_ups"] > 0
        assert closed["load_share"][policy] == round(run["turns_per_s"] / capacity["turns_per_s"], 3) > 0.3
    assert closed["ratio"] == round(closed["loaded"]["prefix_aware"]["follow_up_ttft_ms"]["p50"]
                                    / lone["cached_follow_up_ttft_ms_p50"], 2)
    assert closed["goal_met"] == (closed["ratio"] <= 1.3)

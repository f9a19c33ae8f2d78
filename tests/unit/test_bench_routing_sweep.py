"""The routing sweep: its calibration reads the sim's prefill rate back, reports reach the
picker as late as the lag knob says, the ledger is booked and released per request, a rate is
sustained only while sessions end as fast as they start, and a quick run of the whole sweep
reports every figure for every policy."""

import argparse
import asyncio
from dataclasses import replace

import pytest

from bench.routing_field import run_field
from bench.routing_sweep import MODEL, POLICIES, Fleet, Setup, calibrate_prefill, keeps_up, run_sim
from bench.routing_workloads import SHAPES, Sessions
from bench.virtual_time import VirtualTimeLoop
from llmesh.engine.backends.sim import SimBackend, SimProfile
from llmesh.types import Message


def test_calibration_reads_back_the_engines_peak_prefill_rate():
    assert abs(calibrate_prefill(SimProfile(prefill_ms_per_token=0.1, decode_ms_base=15, max_batch=8,
                                            kv_blocks=4096)) - 10_000) < 100
    assert abs(calibrate_prefill(SimProfile(prefill_ms_per_token=0.5, decode_ms_base=15, max_batch=8,
                                            kv_blocks=4096)) - 2_000) < 20


def test_a_follow_up_turn_hits_the_blocks_its_previous_answer_filled():
    """The history a client sends back repeats the previous prompt and answer token for token (the
    prompt ends in the answer's header, as a chat template's generation prompt does): on one engine
    a follow-up's uncached part is its own new message and what the partial blocks left."""
    profile = SimProfile(decode_ms_base=1.0, output_tokens=64)

    async def main():
        engine = SimBackend(MODEL, 1 << 14, profile)
        fleet = Fleet({"engine-0": engine}, "round_robin", Setup(engines=1), profile)
        history = [Message("user", " ".join(f"w{i}" for i in range(100)))]
        _, answer = await fleet.serve(history, 64)
        history += [Message("assistant", answer), Message("user", "and then")]
        before = engine.prefix_cache_stats()
        await fleet.serve(history, 8)
        after = engine.prefix_cache_stats()
        await engine.close()
        return len(answer.split()), len(fleet.tokenize(history)), after[0] - before[0], after[1] - before[1]

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        words, tokens, queried, hit = runner.run(main())
    assert words == 64 and queried == tokens
    assert hit == (101 + 1 + 64) // 16 * 16  # the first prompt (its header included) and the answer, by full block


def test_reports_reach_the_picker_lag_seconds_late_and_the_ledger_does_not_wait():
    profile = SimProfile(prefill_ms_per_token=1.0, decode_ms_base=10, max_batch=4, output_tokens=400)

    async def main():
        loop = asyncio.get_running_loop()
        engines = {"engine-0": SimBackend(MODEL, 1 << 14, profile)}
        fleet = Fleet(engines, "prefix_aware", Setup(engines=1, report_s=0.5, lag_s=1.0), profile)
        reporter = asyncio.create_task(fleet.reporter())
        t0 = loop.time()
        serving = asyncio.create_task(fleet.serve([Message("user", " ".join(f"w{i}" for i in range(300)))], 400))
        seen = []
        for at in (0.05, 0.45, 0.9, 1.2, 1.6, 2.1):
            await asyncio.sleep(t0 + at - loop.time())
            e = fleet.picker.all()[0]
            seen.append((at, e.running + e.waiting, fleet.picker.local.decode_seqs.get("engine-0", 0),
                         fleet.picker.local.prefill_tokens.get("engine-0", 0)))
        reporter.cancel()
        await engines["engine-0"].close()
        serving.cancel()
        return seen

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        seen = runner.run(main())
    # the ledger: ~303 uncached tokens queued at once, then a decoding sequence after its ~0.3 s prefill
    assert seen[0][3] > 300 and seen[0][2] == 0 and seen[1][2] == 1 and seen[1][3] == 0
    # the reports: the first taken at 0.5 s arrives at 1.5 s; before it the picker saw an idle engine
    assert [s[1] for s in seen[:4]] == [0, 0, 0, 0] and seen[4][1] == 1 and seen[5][1] == 1


def test_every_policy_runs_and_reports_its_figures():
    sessions = Sessions("agentic", seed=2, scale=0.1)
    for policy in (*POLICIES, "prefix_aware/noledger"):
        r = run_sim(sessions, policy, 2.0, Setup(engines=2, duration_s=4.0, report_s=0.2))
        assert r["requests"] > 5 and r["ttft_ms_p50"] > 0 and 0 < r["kv_hit_rate"] < 1, policy
        assert r["input_tokens_s"] > 0 and r["throughput_req_s"] > 0


def test_a_fleet_whose_sessions_pile_up_is_not_sustained_though_their_turns_keep_pace():
    """A session's next turn arrives when its last answer ends, so an overloaded fleet slows its own
    arrivals: finished turns keep up with arrived ones while the sessions in progress pile up."""
    sessions, setup = Sessions("agentic", seed=2, scale=0.25), Setup(engines=2, duration_s=10.0, report_s=0.2)  # 20 s
    over, under = (run_sim(sessions, "round_robin", rate, setup) for rate in (16.0, 4.0))
    half = over["window_s"] / 2
    assert keeps_up(round(over["offered_req_s"] * half), round(over["throughput_req_s"] * half))
    assert over["sessions_ended"] < 0.8 * over["sessions_started"] and not over["sustained"]
    assert keeps_up(under["sessions_started"], under["sessions_ended"]) and under["sustained"]


def test_an_agents_window_holds_whole_sessions_so_a_fleet_that_keeps_up_is_sustained():
    """Sessions are counted over a window's second half. Where that is shorter than a session, the
    sessions ending there started before the window, some before the run: fewer end than start
    though the fleet keeps up (TTFT p99 ~0.1 s here). So a workload's ``window`` scales the run."""
    setup, agentic = Setup(engines=2, duration_s=5.0, report_s=0.2), SHAPES["agentic"]
    short, whole = (run_sim(Sessions(replace(agentic, window=w), seed=2, scale=0.25), "prefix_aware", 16.0, setup)
                    for w in (1.0, 4.0))
    assert (short["window_s"], whole["window_s"]) == (5.0, 20.0)
    assert short["sessions_ended"] < 0.6 * short["sessions_started"] and not short["sustained"]
    assert whole["sustained"] and whole["ttft_ms_p99"] < 1000
    assert agentic.window == SHAPES["agentic_replay"].window == 2.0 and SHAPES["shared_prefix"].window == 1.0


def test_a_closed_loop_keeps_its_users_busy():
    sessions = Sessions("reasoning", seed=2, scale=0.1)
    r = run_sim(sessions, "least_loaded", 0.0, Setup(engines=2, duration_s=5.0, users=3))
    assert r["requests"] >= 6 and r["offered_req_s"] > 0


def test_a_quick_sweep_reports_every_cell_and_the_summary():
    args = argparse.Namespace(quick=True, policies="round_robin,llmd_sticky,dynamo_kv,prefix_aware,prefix_oracle",
                              loads="0.5,1.0", engines=2, report_s=0.5, lag_s=0.0, duration_s=60.0, seed=3,
                              bisect=1, start_rate=4.0, workloads="shared_prefix", sticky_bound_s=0.2, no_peaks=True,
                              lags="", lag_workloads="", closed_users=0)
    out = run_field(args)
    assert out["calibration"]["sticky_penalty_tokens"] == 2000 and out["duration_s"] == 10.0
    (w,) = out["workloads"]
    assert w["saturation"]["rate_sessions_per_s"] > 0 and len(w["results"]) == 2 * 5
    assert {r["policy"] for r in w["results"]} == set(args.policies.split(","))
    assert {"best_anchor", "p99_vs_best_anchor", "p99_vs_round_robin", "hit_vs_oracle"} <= set(out["summary"][0])
    from bench.routing_report import markdown
    assert markdown(out).count("| shared_prefix |") == 2 * 5
    assert "re-implementation" in out["anchors"]["llmd_sticky"] and "re-implementation" in out["anchors"]["dynamo_kv"]
    (ref,) = out["dynamo_reference"]  # the same workload replayed in Dynamo, where make bench-tools installed it
    assert ref["requests"] > 0 and ref["llmesh"]["ttft_p99_rr_over_prefix_aware"] > 0
    assert ref["dynamo"] == {"skipped": "make bench-tools not run"} or ref["dynamo"]["ttft_p99_ms_rr_over_kv"] > 0
    if "skipped" not in ref["dynamo"]:  # and at 80 % of the mock workers' own saturation
        at = ref["dynamo_at_load"]
        assert at["speedup"] == pytest.approx(0.8 * ref["dynamo_saturation"]["speedup"], abs=1e-4)
        assert at["ttft_p99_ms_rr_over_kv"] > 0 and 0 <= at["kv_router_reuse"] <= 1


def test_pooled_runs_pool_every_seeds_requests_for_one_p99_per_policy():
    from bench.routing_report import markdown, pooled, pooled_summary

    setup = Setup(engines=2, duration_s=4.0, report_s=0.2)
    rows = pooled("reasoning", ["least_loaded", "prefix_aware"], [0.5], setup, 0.1, 2.0, seeds=2)
    assert [(r["policy"], r["seeds"], len(r["per_seed_ttft_ms_p99"])) for r in rows] == [
        ("least_loaded", 2, 2), ("prefix_aware", 2, 2)]
    one = [run_sim(Sessions("reasoning", s, 0.1), "least_loaded", 1.0, Setup(engines=2, duration_s=4.0,
                                                                          report_s=0.2, seed=s))
           for s in (1, 2)]
    assert rows[0]["requests"] == sum(r["requests"] for r in one)  # both seeds' requests, pooled
    assert rows[0]["per_seed_ttft_ms_p99"] == [r["ttft_ms_p99"] for r in one]
    assert min(rows[0]["per_seed_ttft_ms_p99"]) <= rows[0]["ttft_ms_p99"] <= max(rows[0]["per_seed_ttft_ms_p99"])
    (summary,) = pooled_summary(rows)
    assert summary["p99_vs_least_loaded"] == round(rows[1]["ttft_ms_p99"] / rows[0]["ttft_ms_p99"], 2)
    out = {"workloads": [], "pooled": rows}
    assert markdown(out).count("| reasoning | 50% |") == 2

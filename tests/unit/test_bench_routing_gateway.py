"""bench.routing_gateway's tallies: a follow-up counts as on its prefix's engine only when the
access log puts it where the conversation's previous turn was served; its load: turns started by a
Poisson process at a share of the measured capacity."""

from __future__ import annotations

import statistics
import threading
import time

from bench.conversation_load import LATE_S, Gauge, Pacer, Turn, occupancy
from bench.routing_gateway import Plan, summarize, ttft_split


def test_follow_ups_counted_on_the_previous_turns_engine():
    turns = [Turn("a", 0, "r1", 0.200, "e0", 190.0), Turn("a", 1, "r2", 0.020, "e0", 15.0),
             Turn("a", 2, "r3", 0.030, "e1", 25.0), Turn("b", 0, "r4", 0.100, "e1"),
             Turn("b", 1, "r5", 0.040, "e1", 35.0), Turn("c", 1, "r6", 0.050, "", None)]
    turns.insert(5, Turn("c", 0, "r0", 0.3, "e0"))
    out = summarize(turns)
    assert out["first_turns"] == 3 and out["follow_ups"] == 4
    assert out["follow_ups_on_prefix_engine"] == 2  # r2 (e0 after e0), r5 (e1 after e1); r6 unlogged
    assert out["follow_up_prefix_hit_rate"] == 0.5
    assert out["follow_up_ttft_ms"]["p50"] == 40.0 and out["first_ttft_ms"]["p99"] == 300.0
    assert out["follow_up_gateway_ttft_ms_p50"] == 25.0
    assert out["turns_per_endpoint"] == {"": 1, "e0": 3, "e1": 3}


def test_occupancy_is_measured_against_the_slots():
    assert Plan().slots == 16 and Plan().conversations == 13  # bench.routing_replicas' closed loop
    gauge = Gauge(client=[12, 13, 14], engines=[8, 10, 12], waiting=[0, 1, 2])
    out = occupancy(gauge, 16)
    assert out == {"slots": 16, "samples": 3, "client_in_flight_share": 0.812, "engines_running_share": 0.625,
                   "engines_waiting_mean": 1.0}


def test_mean_ttft_split_by_who_saw_it():
    turns = [Turn("a", 1, "r1", 0.040, "e0", 30.0), Turn("a", 2, "r2", 0.060, "e0", 50.0),
             Turn("b", 1, "r3", 0.050, "e1", None)]
    # the engines' histogram totals grew by 0.06 s over 3 requests
    assert ttft_split(turns, (1.0, 10), (1.06, 13)) == {"client_ms": 50.0, "gateway_ms": 40.0, "engine_ms": 20.0,
                                                        "engine_requests": 3}
    assert ttft_split([], (0.0, 0), (0.0, 0))["engine_ms"] is None


def test_a_fitted_profile_replaces_the_bench_s_timings(tmp_path):
    import json

    import pytest

    from bench.routing_gateway import DECODE_MS, PREFILL_MS, Plan, fleet, plan_from_args, sim_env

    own = sim_env(Plan())
    assert own["LLMESH_ENGINE_SIM_PREFILL_MS_PER_TOKEN"] == str(PREFILL_MS) and "LLMESH_ENGINE_SIM_PROFILE" not in own
    assert fleet(Plan())["sim_decode_ms_per_step"] == DECODE_MS
    profile = tmp_path / "fitted.json"
    profile.write_text(json.dumps({"prefill_ms_per_token": 2.8, "decode_ms_base": 8.2, "decode_ms_per_seq": 2.2}))
    plan = plan_from_args("bench", "", ["--profile", str(profile), "--duration", "5"], "run")
    assert (plan.profile, plan.duration_s) == (profile, 5.0)
    env = sim_env(plan)
    assert env["LLMESH_ENGINE_SIM_PROFILE"] == str(profile.resolve())
    assert not {"LLMESH_ENGINE_SIM_PREFILL_MS_PER_TOKEN", "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN"} & set(env)
    assert env["LLMESH_ENGINE_MAX_RUNNING"] == str(plan.max_running)
    assert fleet(plan)["sim_profile"]["prefill_ms_per_token"] == 2.8 and "sim_decode_ms_per_step" not in fleet(plan)
    with pytest.raises(SystemExit):
        plan_from_args("bench", "", ["--profile", str(tmp_path / "missing.json")], "run")
    assert own["LLMESH_ENGINE_SIM_PIGGYBACK"] == "false"
    gpu = plan_from_args("bench", "", ["--gpu-steps"], "run")
    assert sim_env(gpu)["LLMESH_ENGINE_SIM_PIGGYBACK"] == "true" and fleet(gpu)["sim_piggyback"] is True
    with pytest.raises(SystemExit):  # a fitted profile has its own step model
        plan_from_args("bench", "", ["--gpu-steps", "--profile", str(profile)], "run")


def test_the_engine_builds_a_piggyback_sim_from_its_settings():
    from llmesh.engine.app import build_backend
    from llmesh.engine.config import EngineSettings

    backend = build_backend(EngineSettings(backend="sim", model="sim-x", sim_piggyback=True,
                                           sim_prefill_ms_per_token=0.3, sim_decode_ms_per_token=10.0))
    assert backend.profile.piggyback and backend.profile.step_s(4, 20) == 0.010
    assert not build_backend(EngineSettings(backend="sim", model="sim-x")).profile.piggyback


def test_the_pacer_starts_turns_by_a_poisson_process_at_its_rate():
    times = list(Pacer(20.0, seed=3).times(100.0, 200.0))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert abs(len(times) / 100.0 - 20.0) < 1.0  # ~2,000 starts in 100 s
    assert abs(statistics.fmean(gaps) - 0.05) < 0.003 and abs(statistics.stdev(gaps) - 0.05) < 0.005  # exponential
    assert 100.0 < times[0] and times[-1] < 200.0


def test_each_start_goes_to_a_free_user_picked_at_random_and_the_users_are_released_at_the_end():
    pacer, picks, lock = Pacer(200.0, seed=5), [], threading.Lock()

    def user(i: int) -> None:
        while pacer.wait():
            with lock:
                picks.append(i)
            time.sleep(0.001)  # its turn: short beside the 5 ms between starts, so all 8 are mostly free

    users = [threading.Thread(target=user, args=(i,)) for i in range(8)]
    for u in users:
        u.start()
    pacer.run(time.monotonic() + 0.8)
    for u in users:
        u.join(5)
    assert not any(u.is_alive() for u in users)  # every waiting user was let go when the starts ended
    assert len(picks) == pacer.started > 100 and set(picks) == set(range(8))
    # users freed in turn do not take starts in turn (round robin's rotation would then keep each on one
    # engine): the picks do not repeat with the users' period (in turn: ~1.0; at random: ~1/8)
    in_turn = sum(b == a for a, b in zip(picks, picks[8:])) / (len(picks) - 8)
    assert in_turn < 0.4
    assert LATE_S > 0 and pacer.late <= pacer.started


def test_the_closed_loop_at_80_percent_takes_the_users_interpolated_from_the_capacity_loops():
    from bench.routing_gateway import closed_users

    runs = [{"users": 8, "turns_per_s": 60.0}, {"users": 12, "turns_per_s": 90.0}, {"users": 16, "turns_per_s": 100.0}]
    # 80 % of 100 turns/s lies two thirds of the way from 8 users' 60 to 12 users' 90
    assert closed_users(Plan(), {"turns_per_s": 100.0, "users": 16, "runs": runs}) == 11
    # below the lightest loop: from (0, 0)
    assert closed_users(Plan(), {"turns_per_s": 100.0, "users": 16, "runs": [{"users": 16, "turns_per_s": 100.0}]}) \
        == 13
    # all of the capacity: the best loop's users, reached on the last segment
    assert closed_users(Plan(load=1.0), {"turns_per_s": 100.0, "users": 16, "runs": runs}) == 16
    # a target no loop's rate reaches (a load above 1, or a fleet that served nothing) keeps the best loop's users
    assert closed_users(Plan(load=1.2), {"turns_per_s": 100.0, "users": 16, "runs": runs}) == 16
    assert closed_users(Plan(), {"turns_per_s": 0.0, "users": 8, "runs": [{"users": 8, "turns_per_s": 0.0}]}) == 8

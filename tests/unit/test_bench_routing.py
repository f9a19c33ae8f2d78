"""The routing bench's workload is fixed by its seed (every policy sees the same
conversations), shares prefixes only when asked, and a short run reports every figure."""

import argparse
import asyncio

from bench.routing import Workload, find_saturation, run_sim
from bench.virtual_time import VirtualTimeLoop
from llmesh.engine.backends.sim import SimProfile


def test_workload_is_seeded_and_sharing_is_a_switch():
    a, b = Workload(3, tenants=2, docs=1, sharing=True), Workload(3, tenants=2, docs=1, sharing=True)
    assert [a.conversation(n) for n in range(20)] == [b.conversation(n) for n in range(20)]
    firsts = {a.conversation(n)[0][0].content for n in range(20)}
    assert len(firsts) <= 3                       # 2 tenants' system prompts + the document instruction
    alone = Workload(3, tenants=2, docs=1, sharing=False)
    assert len({alone.conversation(n)[0][0].content for n in range(20)}) == 20


def test_a_short_run_reports_every_figure():
    args = argparse.Namespace(engines=2, report_s=0.1, seed=1, max_tokens=4, think_s=0.05, duration_s=0.6)
    r = run_sim(args, Workload(1, 2, 1, True), "prefix_aware", 5.0,
                SimProfile(prefill_ms_per_token=0.01, decode_ms_base=1, output_tokens=4))
    assert r["requests"] > 0 and r["ttft_ms_p50"] > 0 and 0 < r["kv_hit_rate"] < 1
    assert set(r) >= {"ttft_ms_p99", "throughput_req_s", "offered_req_s", "sustained", "output_tokens_s",
                      "load_imbalance_max_over_mean"}


def test_virtual_clock_jumps_to_the_next_timer_and_times_hold():
    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.gather(asyncio.sleep(3600), asyncio.sleep(1800))
        return loop.time() - t0

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        import time
        wall = time.monotonic()
        assert abs(runner.run(main()) - 3600) < 1e-6      # an hour of simulated time...
        assert time.monotonic() - wall < 5                 # ...in well under its length


def test_saturation_is_where_throughput_stops_following_the_offered_rate():
    # one engine, one slot; a request's first token comes with its (free) prefill, then
    # 3 decode steps of 12.5 ms: it finishes at most 1 / 37.5 ms = 26.7 requests a second
    profile = SimProfile(prefill_ms_per_token=0.0, decode_ms_base=12.5, max_batch=1, output_tokens=4)
    args = argparse.Namespace(engines=1, report_s=0.5, seed=1, max_tokens=4, think_s=0.5, duration_s=40,
                              start_rate=1.0, bisect=3)
    wl = Workload(1, 1, 1, False, system_words=5, doc_words=5)
    sat = find_saturation(args, wl, profile, "least_loaded")
    assert 22 <= sat["throughput_req_s"] <= 27
    over = run_sim(args, wl, "least_loaded", sat["rate_conversations_per_s"] * 2, profile)
    assert not over["sustained"] and over["throughput_req_s"] < over["offered_req_s"]


def test_sglang_baseline_follows_its_published_rule():
    from bench.routing import SglangApprox
    r = SglangApprox(["a", "b"], cache_threshold=0.3, balance_abs=4, balance_rel=1.5)
    doc = "x" * 640
    first = r.choose(doc + "q1", {"a": 0, "b": 0})
    assert r.choose(doc + "q2", {"a": 0, "b": 0}) == first                 # match above the threshold
    other = "b" if first == "a" else "a"
    assert r.choose("y" * 640, {"a": 0, "b": 0}) == other                  # no match: the smaller index
    busy = {first: 10, other: 0}
    assert r.choose(doc + "q3", busy) == other                              # imbalanced: shortest queue


def test_prompt_sizes_are_knobs():
    small = Workload(3, tenants=1, docs=1, sharing=True, system_words=10, doc_words=20, question_words=6)
    convs = [small.conversation(n) for n in range(20)]
    for turns in convs:
        first = turns[0]
        if first[0].content == "answer from the document":
            assert len(first[1].content.split()) == 20 + 1 + 4     # the document, "question:", 2/3 of 6
        else:
            assert [len(m.content.split()) for m in first] == [10, 6]
            assert all(len(t[0].content.split()) == 4 for t in turns[1:])

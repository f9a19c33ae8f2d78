"""The routing bench's workload is fixed by its seed (every policy sees the same
conversations), shares prefixes only when asked, and a short run reports every figure."""

import argparse
import asyncio

from bench.routing import Workload, run_one
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
    r = asyncio.run(run_one(args, Workload(1, 2, 1, True), "prefix_aware", 5.0,
                            SimProfile(prefill_ms_per_token=0.01, decode_ms_base=1, output_tokens=4)))
    assert r["requests"] > 0 and r["ttft_ms_p50"] > 0 and 0 < r["kv_hit_rate"] < 1
    assert set(r) >= {"ttft_ms_p99", "throughput_req_s", "output_tokens_s", "load_imbalance_max_over_mean"}


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

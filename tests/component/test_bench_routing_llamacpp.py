"""The routing bench's ``--backend llamacpp`` path on two real llama.cpp engines
with SmolLM2: a short run gets answers, and follow-up turns reuse their prefix."""

import argparse

from bench.routing import Workload, llamacpp_results


def test_a_short_llamacpp_run_reports_every_policy(real_model_dir):
    args = argparse.Namespace(engines=2, rates="2", duration_s=2.0, report_s=0.2, seed=3, max_tokens=2,
                              think_s=0.1, model_dir=real_model_dir, model="smollm2-135m-instruct", slots=2,
                              threads=1, n_ctx=1024)
    results = llamacpp_results(args, Workload(3, tenants=1, docs=1, sharing=True, system_words=8, doc_words=8,
                                              question_words=2), ["least_loaded", "prefix_aware"])
    assert [r["policy"] for r in results] == ["least_loaded", "prefix_aware"]
    for r in results:
        assert r["requests"] > 0 and r["ttft_ms_p50"] > 0
    assert results[1]["kv_hit_rate"] > 0          # the tenant's system prompt and histories are reused

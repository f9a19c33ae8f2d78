"""The routing sweep's external reference: each workload's requests, as the round_robin run at
80 % of the best baseline's saturation sent them, replayed in Dynamo's offline router replay
(``bench.dynamo_replay``: its ``kv_router`` and ``round_robin`` on its mock vLLM engine, with
the sim engines' KV room and batch), beside llmesh's own ratio on the same cell: round_robin's
TTFT over prefix_aware's. Dynamo's mock keeps its own timing model: compare the ratios, not
the milliseconds, and at the same share of each side's own saturation (``dynamo_at_load``).
A multi-turn workload's later turns keep the arrival times llmesh's run gave them (the replay
cannot make a turn wait for the answer before it)."""

from __future__ import annotations

from bench.common import note
from bench.dynamo_replay import from_tokens, replay, saturation, to_trace
from bench.routing_sweep import PROFILE, Setup, keeps_up, run_sim
from bench.routing_workloads import Sessions

LOAD = 0.8


def _ours(w: dict) -> dict:
    """llmesh's round_robin / prefix_aware TTFT ratios at the sweep's load nearest ``LOAD``."""
    loads = {r["load_of_saturation"] for r in w["results"]}
    near = min(loads, key=lambda x: abs(x - LOAD), default=None)
    cell = {r["policy"]: r for r in w["results"] if r["load_of_saturation"] == near}
    rr, pa = cell.get("round_robin"), cell.get("prefix_aware")
    if rr is None or pa is None:
        return {}
    return {"load_of_saturation": near, **{f"ttft_{q}_rr_over_prefix_aware":
                                            round(rr[f"ttft_ms_{q}"] / max(pa[f"ttft_ms_{q}"], 1e-9), 2)
                                            for q in ("p50", "p99")}}


def dynamo_reference(per: list[dict], setup: Setup, scale: float) -> list[dict]:
    """Per workload: Dynamo's ratios on the trace as sent (``dynamo``: the arrival times of llmesh's
    run, which may load Dynamo's mock workers more or less than llmesh's sim ones) and at 80 % of
    the mock workers' own saturation (``dynamo_at_load``: the trace sped up or slowed down to
    ``LOAD`` x the highest rate Dynamo's round_robin keeps up with, found by ``saturation``
    with the sim's rule), so each side's ratio is taken at the same share of its own capacity."""
    out = []
    for w in per:
        rate = LOAD * w["saturation"]["rate_sessions_per_s"]
        sent: list = []
        run_sim(Sessions(w["workload"], setup.seed, scale), "round_robin", rate, setup, PROFILE, sent)
        bs = PROFILE.block_size
        trace = to_trace([from_tokens(t, tokens, m, bs) for t, tokens, m in sent], bs)
        args = {"workers": setup.engines, "block_size": bs,
                "engine": {"num_gpu_blocks": PROFILE.kv_blocks, "max_num_seqs": PROFILE.max_batch}}
        dynamo = replay(trace, **args)
        row = {"workload": w["workload"], "load_of_saturation": LOAD, "requests": len(trace),
               "llmesh": _ours(w), "dynamo": dynamo.get("ratios", dynamo)}
        found = saturation(trace, keeps_up, **args)
        if "skipped" not in found:
            matched = replay(trace, speedup=round(LOAD * found["speedup"], 4), **args)
            row["dynamo_saturation"] = found
            row["dynamo_at_load"] = {"speedup": matched["speedup"], **matched["ratios"],
                                     "kv_router_reuse": matched["kv_router"].get("prefix_reuse"),
                                     "round_robin_reuse": matched["round_robin"].get("prefix_reuse")}
        note(f"dynamo replay {w['workload']:<14} llmesh rr/prefix_aware {row['llmesh']} dynamo rr/kv {row['dynamo']}"
             f" at its own {LOAD:.0%}: {row.get('dynamo_at_load')}")
        out.append(row)
    return out

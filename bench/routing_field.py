"""``python -m bench.routing``'s default run: the field's workloads (``bench.routing_workloads``)
swept by ``bench.routing_report`` on sim engines (``bench.routing_sweep``). ``--quick``: every
workload at a quarter of its sizes, short runs, no per-policy peaks, lag study or closed loop
(what the tests run)."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

from bench.common import note
from bench.routing_dynamo import dynamo_reference
from bench.routing_report import closed_loop, lag_study, markdown, pooled, pooled_summary, summary, workload
from bench.routing_sweep import POLICIES, PROFILE, Setup, calibrate_prefill
from bench.routing_workloads import SHAPES, WORKLOADS


def field_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="small and short: every figure, not its value")
    ap.add_argument("--lag-s", type=float, default=0.0, help="reports reach the picker this late")
    ap.add_argument("--lags", default="0,1,3", help="the lag study's report lags, seconds (empty: none)")
    ap.add_argument("--lag-workloads", default="shared_prefix,agentic", help="workloads of the lag study")
    ap.add_argument("--sticky-bound-s", type=float, default=0.2,
                    help="llmd_sticky's time bound: penalty = calibrated peak prefill tokens/s x this")
    ap.add_argument("--closed-users", type=int, default=32, help="the closed loop's users (agentic; 0: none)")
    ap.add_argument("--no-peaks", action="store_true", help="skip each policy's own saturation search")
    ap.add_argument("--pooled-seeds", type=int, default=8,
                    help="seeds 1..N of each --pooled-workloads cell, requests pooled for its p99 (0: none)")
    ap.add_argument("--pooled-workloads", default="reasoning", help="workloads of the pooled runs")


def run_field(args: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    quick = args.quick
    policies = (args.policies or ",".join(POLICIES)).split(",")
    for p in policies:
        if p.partition("/")[0] not in POLICIES:
            raise SystemExit(f"unknown policy {p!r}; one of {', '.join(POLICIES)}")
    loads = [float(x) for x in (args.loads or "0.5,0.8,1.0").split(",")]
    peak_prefill = calibrate_prefill(PROFILE)
    penalty = int(peak_prefill * args.sticky_bound_s)
    setup = Setup(engines=args.engines, report_s=args.report_s, lag_s=args.lag_s,
                  duration_s=10.0 if quick else args.duration_s or 40.0, seed=args.seed, sticky_penalty_tokens=penalty)
    scale, bisect = (0.25, 1) if quick else (1.0, 3 if args.bisect is None else args.bisect)
    note(f"calibration: peak prefill {peak_prefill:.0f} tokens/s; llmd_sticky penalty {penalty} tokens "
         f"({args.sticky_bound_s} s)")
    names = args.workloads.split(",")
    per = [workload(n, policies, loads, setup, scale, args.start_rate, bisect, peaks=not (quick or args.no_peaks))
           for n in names]
    out: dict = {"bench": "routing", "backend": "sim", "engines": setup.engines, "report_s": setup.report_s,
                 "lag_s": setup.lag_s, "duration_s": setup.duration_s, "quick": quick, "profile": asdict(PROFILE),
                 "calibration": {"peak_prefill_tokens_s": round(peak_prefill), "sticky_bound_s": args.sticky_bound_s,
                                 "sticky_penalty_tokens": penalty},
                 "anchors": {"llmd_sticky": "re-implementation of llm-d's sticky-until-saturated from its published "
                                            "description (affinity >= 0.8, calibrated penalty, token load)",
                             "dynamo_kv": "re-implementation of Dynamo's KV router cost from its published "
                                          "description (overlap-weighted prefill blocks + active decode blocks)"},
                 "workloads": per, "summary": summary(per)}
    out["dynamo_reference"] = dynamo_reference(per, setup, scale)
    if not quick:
        lags = [float(x) for x in args.lags.split(",") if x]
        out["lag_study"] = [r for n in args.lag_workloads.split(",") if n in names and lags
                            for w in per if w["workload"] == n
                            for r in lag_study(n, lags, setup, scale, 0.8 * w["saturation"]["rate_sessions_per_s"])]
        if args.pooled_seeds:
            out["pooled"] = [r for w in per if w["workload"] in args.pooled_workloads.split(",")
                             for r in pooled(w["workload"], policies, loads, setup, scale,
                                             w["saturation"]["rate_sessions_per_s"], args.pooled_seeds)]
            out["pooled_summary"] = pooled_summary(out["pooled"])
        if args.closed_users and "agentic" in names:
            out["closed_loop"] = closed_loop("agentic", policies, args.closed_users, setup, scale)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    note(markdown(out))
    return out

"""The routing sweep's plan and its summary: per workload the best baseline's saturation,
every policy at fractions of it, each policy's own peak, the ledger against report lag, a
closed loop; then the issue's goals checked on the figures (prefix_aware against the best
re-implemented anchor, round_robin, least_loaded and the oracle)."""

from __future__ import annotations

from dataclasses import replace

from bench.common import note, pct
from bench.routing_sweep import Setup, find_saturation, run_sim
from bench.routing_workloads import Sessions

BASELINES = ("round_robin", "least_loaded")
ANCHORS = ("llmd_sticky", "dynamo_kv")


def cells(sessions: Sessions, policies: list[str], loads: list[float], rate: float, setup: Setup) -> list[dict]:
    out = []
    for load in loads:
        for policy in policies:
            r = run_sim(sessions, policy, rate * load, setup)
            r["load_of_saturation"] = load
            note(f"{sessions.name:<14} {load:4.0%} {policy:<14} ttft p50 {r['ttft_ms_p50']:7.1f} p99 "
                 f"{r['ttft_ms_p99']:7.1f} ms hit {r['kv_hit_rate']:.3f} {r['throughput_req_s']}/"
                 f"{r['offered_req_s']} req/s")
            out.append(r)
    return out


def workload(name: str, policies: list[str], loads: list[float], setup: Setup, scale: float, start: float,
             bisect: int, peaks: bool) -> dict:
    """One workload: saturation of the best baseline, the cells, each policy's own peak."""
    sessions = Sessions(name, setup.seed, scale)
    sats = [find_saturation(sessions, p, setup, start, bisect) for p in BASELINES]
    best = max(sats, key=lambda s: s["rate_sessions_per_s"])
    out = {"workload": name, "saturation": {"policy": best["policy"], "rate_sessions_per_s":
                                            best["rate_sessions_per_s"], "throughput_req_s": best["throughput_req_s"]},
           "results": cells(sessions, policies, loads, best["rate_sessions_per_s"], setup)}
    if peaks:  # the highest rate each policy sustains: throughput where it counts
        known = {s["policy"]: s for s in sats}
        out["peak"] = {p: known.get(p) or find_saturation(sessions, p, setup, best["rate_sessions_per_s"], bisect)
                       for p in policies}
    return out


def lag_study(name: str, lags: list[float], setup: Setup, scale: float, rate: float) -> list[dict]:
    """The ledger against report lag: prefix-aware policies with and without it."""
    sessions, out = Sessions(name, setup.seed, scale), []
    for lag in lags:
        for policy in ("prefix_aware", "prefix_aware/noledger", "llmd_sticky", "llmd_sticky/noledger"):
            r = run_sim(sessions, policy, rate, replace(setup, lag_s=lag))
            r["lag_s"] = lag
            note(f"lag {lag:4.1f} s {name:<14} {policy:<22} ttft p50 {r['ttft_ms_p50']:7.1f} p99 "
                 f"{r['ttft_ms_p99']:7.1f} ms hit {r['kv_hit_rate']:.3f}")
            out.append(r)
    return out


def closed_loop(name: str, policies: list[str], users: int, setup: Setup, scale: float) -> list[dict]:
    sessions, out = Sessions(name, setup.seed, scale), []
    for policy in policies:
        r = run_sim(sessions, policy, 0.0, replace(setup, users=users))
        r["users"] = users
        note(f"closed {users} users {name:<14} {policy:<14} ttft p50 {r['ttft_ms_p50']:7.1f} p99 "
             f"{r['ttft_ms_p99']:7.1f} ms {r['throughput_req_s']} req/s hit {r['kv_hit_rate']:.3f}")
        out.append(r)
    return out


def pooled(name: str, policies: list[str], loads: list[float], setup: Setup, scale: float, rate: float,
           seeds: int) -> list[dict]:
    """Every policy at each load over ``seeds`` seeds (workload and arrivals), its requests pooled:
    a p99 from a few hundred requests is their fifth-slowest, too noisy to tell a 5 % difference."""
    out = []
    for load in loads:
        for policy in policies:
            ttfts: list[float] = []
            per = [run_sim(Sessions(name, s, scale), policy, rate * load, replace(setup, seed=s), ttfts=ttfts)
                   ["ttft_ms_p99"] for s in range(1, seeds + 1)]
            r = {"workload": name, "load_of_saturation": load, "policy": policy, "seeds": seeds,
                 "requests": len(ttfts), "ttft_ms_p50": round(pct(ttfts, 50) * 1000, 1),
                 "ttft_ms_p99": round(pct(ttfts, 99) * 1000, 1), "per_seed_ttft_ms_p99": per}
            note(f"pooled {seeds} seeds {name:<12} {load:4.0%} {policy:<14} ttft p50 {r['ttft_ms_p50']:7.1f} "
                 f"p99 {r['ttft_ms_p99']:7.1f} ms ({len(ttfts)} requests)")
            out.append(r)
    return out


def pooled_summary(rows: list[dict]) -> list[dict]:
    """Per workload and load of the pooled runs: prefix_aware's pooled TTFT p99 over least_loaded's
    and over the better anchor's."""
    by = {(r["workload"], r["load_of_saturation"], r["policy"]): r["ttft_ms_p99"] for r in rows}
    out = []
    for (name, load, policy), p99 in by.items():
        if policy != "prefix_aware":
            continue
        row: dict = {"workload": name, "load": load}
        if (name, load, "least_loaded") in by:
            row["p99_vs_least_loaded"] = _ratio(p99, by[(name, load, "least_loaded")])
        anchors = [by[(name, load, a)] for a in ANCHORS if (name, load, a) in by]
        if anchors:
            row["p99_vs_best_anchor"] = _ratio(p99, min(anchors))
        out.append(row)
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def summary(per_workload: list[dict]) -> list[dict]:
    """Per workload and load: prefix_aware's TTFT p99 and throughput over the best anchor's
    (the anchor of the lower p99 there), round_robin's and least_loaded's, and its hit rate
    over the oracle's; peak throughput ratios where each policy's peak was searched."""
    out = []
    for w in per_workload:
        by = {(r["load_of_saturation"], r["policy"]): r for r in w["results"]}
        for load in sorted({r["load_of_saturation"] for r in w["results"]}):
            pa = by.get((load, "prefix_aware"))
            if pa is None:
                continue
            row: dict = {"workload": w["workload"], "load": load}
            anchors = [by[(load, a)] for a in ANCHORS if (load, a) in by]
            if anchors:
                best = min(anchors, key=lambda r: r["ttft_ms_p99"])
                row.update(best_anchor=best["policy"],
                           p99_vs_best_anchor=_ratio(pa["ttft_ms_p99"], best["ttft_ms_p99"]),
                           throughput_vs_best_anchor=_ratio(pa["throughput_req_s"], best["throughput_req_s"]))
            for base in BASELINES:
                if (load, base) in by:
                    row[f"p99_vs_{base}"] = _ratio(pa["ttft_ms_p99"], by[(load, base)]["ttft_ms_p99"])
            if (load, "prefix_oracle") in by:
                row["hit_vs_oracle"] = _ratio(pa["kv_hit_rate"], by[(load, "prefix_oracle")]["kv_hit_rate"])
            out.append(row)
        peak = w.get("peak")
        if peak and "prefix_aware" in peak:
            top = peak["prefix_aware"]["throughput_req_s"]
            out.append({"workload": w["workload"], "load": "peak",
                        **{f"peak_throughput_vs_{p}": _ratio(top, peak[p]["throughput_req_s"])
                           for p in peak if p != "prefix_aware"}})
    return out


def markdown(out: dict) -> str:
    """The sweep's cells as a markdown table (one row per workload, load and policy), then
    each policy's peak throughput per workload."""
    rows = ["| workload | load | policy | TTFT p50 ms | TTFT p99 ms | req/s | input tok/s | KV hit |",
            "|---|---|---|---|---|---|---|---|"]
    for w in out["workloads"]:
        for r in w["results"]:
            rows.append(f"| {w['workload']} | {r['load_of_saturation']:.0%} | {r['policy']} | {r['ttft_ms_p50']} | "
                        f"{r['ttft_ms_p99']} | {r['throughput_req_s']} | {r['input_tokens_s']} | {r['kv_hit_rate']} |")
    if out.get("pooled"):
        rows += ["", "| pooled workload | load | policy | seeds | requests | TTFT p50 ms | TTFT p99 ms |",
                 "|---|---|---|---|---|---|---|"]
        rows += [f"| {r['workload']} | {r['load_of_saturation']:.0%} | {r['policy']} | {r['seeds']} | "
                 f"{r['requests']} | {r['ttft_ms_p50']} | {r['ttft_ms_p99']} |" for r in out["pooled"]]
    peaks = [w for w in out["workloads"] if w.get("peak")]
    if peaks:
        names = list(peaks[0]["peak"])
        rows += ["", "| peak req/s | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        rows += [f"| {w['workload']} | " + " | ".join(str(w["peak"][n]["throughput_req_s"]) for n in names) + " |"
                 for w in peaks]
    return "\n".join(rows)

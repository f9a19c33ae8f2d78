"""``python -m bench.fairness --json``: overload without unfairness. A mesh of sim engines (3 x 16
running slots, 32 waiting each) behind a gateway with flow control on; three tenants send
streamed chat completions by Poisson arrivals, each with a deadline (``x-request-timeout``):

- ``heavy`` at 10x the rate of ``light`` (weights 1:1), both in the standard class;
- ``vip``, a ``critical`` tenant (its grant's priority high), at 10 % of the traffic.

The flood comes from a client process of its own, light and vip from another (two applications),
so that the flood's client load cannot delay the light tenant's timings on a small machine.

Phases: unloaded (light and vip alone, at their rates of the first overload), then at each
``--loads`` multiple of the engines' saturation (slots over a request's service time). Per tenant:
served tokens/s and share, TTFT p50/p90/p99 (first content byte, wait included), refusals by
reason, and requests that got no answer by their deadline (there should be none). The share
goal (issue 30) holds while both standard tenants have work waiting; a tenant asking for less
than its weight's share is owed what it asks (max-min fairness), and the bench reports that
expected share next to the served one."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from llmesh.liveconfig.schema import MeshConfig
from llmesh.testing import Mesh, free_layout, wait_until
from bench.common import note, pct
from bench.fairness_virtual import run_virtual

MODEL = "sim-small"
ENGINES, RUNNING, WAITING = 3, 16, 32
TOKENS, DECODE_MS = 32, 50  # a request: 8-56 output tokens (32 on average), 50 ms a decode step: ~1.6 s
TENANTS = ("heavy", "light", "vip")
CLASS = {"heavy": "standard", "light": "standard", "vip": "critical"}
QUIET = 0.1  # of the slots, left to tenants with nothing waiting (light)
CONFIG = {
    "tenants": {"heavy": {"weight": 1}, "light": {"weight": 1}, "vip": {"priority": "high"}},
    "flow_control": {"enabled": True, "max_queued_per_tenant": 256, "max_queued": 2048,
                     "quiet_share": QUIET,
                     "classes": {"critical": {"reserved_share": 0.2}, "standard": {"promote_after_s": 30},
                                 "batch": {"promote_after_s": 60}}},
}


@dataclass
class Result:
    tenant: str
    sent: float  # seconds since the phase began
    status: int = 0
    reason: str = ""
    ttft_s: float | None = None
    done_s: float | None = None  # when the answer (or refusal) ended, since the phase began
    answered_s: float | None = None  # when the first byte of the answer or refusal came, since it was sent
    tokens: int = 0
    asked: int = 0  # its max_tokens: what it asked for


@dataclass
class Phase:
    name: str
    rates: dict[str, float]
    seconds: float
    results: list[Result] = field(default_factory=list)
    lag_ms: list[float] = field(default_factory=list)  # the bench client's own event-loop lag, sampled
    # the mesh run: the gateway's access log, per request (tenant, sent s since the phase began, first byte of
    # its answer or refusal in s since it came): the deadline goal read where it is kept, not at a client
    gateway: list[tuple[str, float, float]] = field(default_factory=list)


async def watch_lag(phase: Phase, every_s: float = 0.05) -> None:
    """How late the client's loop wakes: past a few ms, its timings measure this machine, not the mesh."""
    while True:
        start = time.perf_counter()
        await asyncio.sleep(every_s)
        phase.lag_ms.append((time.perf_counter() - start - every_s) * 1000)


async def one(client: httpx.AsyncClient, url: str, key: str, r: Result, t0: float, deadline_s: float,
              max_tokens: int) -> None:
    body = {"model": MODEL, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "tell me a story"}]}
    start = time.perf_counter()
    headers = {"authorization": f"Bearer {key}", "x-request-timeout": str(deadline_s)}
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            r.status, r.answered_s = resp.status_code, time.perf_counter() - start
            if resp.status_code != 200:
                r.reason = orjson.loads(await resp.aread()).get("error", {}).get("code") or str(resp.status_code)
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if r.ttft_s is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    r.ttft_s = time.perf_counter() - start
                if chunk.get("usage"):
                    r.tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError) as exc:
        r.reason = type(exc).__name__
    finally:
        r.done_s = time.perf_counter() - t0


async def run_phase(url: str, keys: dict[str, str], phase: Phase, deadline_s: float, seed: int,
                    t0: float | None = None) -> None:
    """The phase's arrivals of every tenant in ``phase.rates``, from ``t0`` (a perf_counter time:
    the same clock in every process of this machine; None: now)."""
    rng = random.Random(seed)
    t0 = time.perf_counter() if t0 is None else t0
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    tasks: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=deadline_s + 30, limits=limits) as client:
        async def arrivals(tenant: str, rate: float) -> None:
            t = rng.expovariate(rate)
            while t < phase.seconds:
                await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
                max_tokens = rng.randint(TOKENS // 4, TOKENS * 7 // 4)  # answers of mixed lengths
                r = Result(tenant, time.perf_counter() - t0, asked=max_tokens)
                phase.results.append(r)
                tasks.append(asyncio.create_task(one(client, url, keys[tenant], r, t0, deadline_s, max_tokens)))
                t += rng.expovariate(rate)

        lag = asyncio.create_task(watch_lag(phase))
        await asyncio.gather(*(arrivals(t, rate) for t, rate in phase.rates.items() if rate > 0))
        lag.cancel()
        for task in tasks:  # the phase is over: what is still streaming or waiting is cut off
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def summary(phase: Phase, warmup_s: float, deadline_s: float) -> dict:
    window = phase.seconds - warmup_s
    out: dict = {"offered_per_s": {t: round(r, 2) for t, r in phase.rates.items()}, "tenants": {}}
    served: dict[str, float] = {}
    for tenant in phase.rates:
        mine = [r for r in phase.results if r.tenant == tenant and r.sent >= warmup_s]
        ok = [r for r in mine if r.status == 200 and r.ttft_s is not None]
        tokens = sum(r.tokens for r in phase.results if r.tenant == tenant and r.status == 200
                     and r.done_s is not None and warmup_s <= r.done_s <= phase.seconds)
        served[tenant] = tokens / window
        refusals: dict[str, int] = {}
        for r in mine:
            if r.status != 200 and r.reason:
                refusals[r.reason] = refusals.get(r.reason, 0) + 1
        ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        late = sum(1 for r in mine if r.answered_s is not None and r.answered_s > deadline_s + 0.5)
        out["tenants"][tenant] = {
            "class": CLASS[tenant], "sent": len(mine), "served": len(ok),
            "served_tokens_per_s": round(served[tenant], 1),
            "ttft_ms": {"p50": round(pct(ttft, 50), 1), "p90": round(pct(ttft, 90), 1), "p99": round(pct(ttft, 99), 1)},
            "refusals": refusals, "answered_past_deadline": late}
        if phase.gateway:  # the client's count, above, includes its own delays (a flood's client lags)
            out["tenants"][tenant]["gateway_answered_past_deadline"] = sum(
                1 for t, sent, first in phase.gateway if t == tenant and sent >= warmup_s and first > deadline_s + 0.5)
    out["served_tokens_per_s"] = round(sum(served.values()), 1)
    if phase.lag_ms:  # the mesh run's client: a lag of seconds means the figures are this machine's
        out["client_loop_lag_ms"] = {"p50": round(pct(phase.lag_ms, 50), 1), "p99": round(pct(phase.lag_ms, 99), 1),
                                     "max": round(max(phase.lag_ms), 1)}
    std = served.get("heavy", 0) + served.get("light", 0)
    if std:
        capacity = std  # the standard class's served tokens/s: split max-min fairly, weights 1:1
        # each tenant's ask: the tokens its requests sent in the window asked for (the draws this run made,
        # not the nominal rate's mean: a tenant under its share is owed what it really asked)
        asks = {t: sum(r.asked for r in phase.results if r.tenant == t and warmup_s <= r.sent <= phase.seconds)
                / window for t in ("heavy", "light")}
        fair = _max_min(capacity, asks)
        out["standard_share"] = {t: {"served": round(served[t] / std, 3), "expected": round(fair[t] / capacity, 3)}
                                 for t in ("heavy", "light") if t in phase.rates}
    return out


def _max_min(capacity: float, asks: dict[str, float]) -> dict[str, float]:
    """Equal weights: each gets its ask or an equal share of what is left, whichever is less."""
    got, left, open_ = {t: 0.0 for t in asks}, capacity, dict(asks)
    while open_ and left > 1e-9:
        share = left / len(open_)
        small = {t: a for t, a in open_.items() if a <= share}
        if not small:
            for t in open_:
                got[t] += share
            break
        for t, a in small.items():
            got[t], left = got[t] + a, left - a
            del open_[t]
    return got


def _start_mesh(root: Path) -> tuple[Mesh, dict[str, str]]:
    (root / "llmesh.yaml").write_text(json.dumps(CONFIG))
    logs = root / "logs"
    keys = {t: subprocess.run([sys.executable, "-m", "llmesh", "keys", "create", "--tenant", t, "--keys-file",
                               str(logs / "state" / "keys.json")], capture_output=True, text=True,
                              check=True).stdout.strip().splitlines()[-1] for t in TENANTS}
    mesh = Mesh(layout=free_layout(n_engines=ENGINES), engines=f"sim:{ENGINES}", model_dir=root / "models",
                log_dir=logs, args=["--no-cache"],
                env={"LLMESH_CONFIG_FILE": str(root / "llmesh.yaml"), "LLMESH_ENGINE_MAX_RUNNING": str(RUNNING),
                     "LLMESH_ENGINE_MAX_WAITING": str(WAITING), "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": str(2 * TOKENS),
                     "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": str(DECODE_MS), "LLMESH_GATEWAY_AUDIT": "false",
                     "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600", "LLMESH_GATEWAY_LOOP_WATCH_MS": "0"})
    mesh.start(timeout_s=240)
    return mesh, keys


def _goals(report: dict) -> dict:
    unloaded = report["unloaded"]["tenants"]
    goals: dict = {}
    for name, phase in report.items():
        if not name.startswith("load_"):
            continue
        t = phase["tenants"]
        share = phase.get("standard_share", {})
        goals[name] = {
            "share_within_10pct": all(abs(s["served"] - s["expected"]) <= 0.1 * s["expected"] for s in share.values()),
            "light_ttft_p90_ratio": round(t["light"]["ttft_ms"]["p90"] / unloaded["light"]["ttft_ms"]["p90"], 2),
            "critical_ttft_p90_ratio": round(t["vip"]["ttft_ms"]["p90"] / unloaded["vip"]["ttft_ms"]["p90"], 2),
            "answered_past_deadline": sum(x.get("gateway_answered_past_deadline", x["answered_past_deadline"])
                                          for x in t.values())}
    return goals


def _virtual(phases: list[Phase], deadline_s: float) -> None:
    def record(i: int):
        def add(tenant: str, sent: float, ttft: float | None, tokens: int, reason: str, done: float,
                asked: int) -> None:
            phases[i].results.append(Result(tenant, sent, 429 if reason else 200, reason, ttft, done,
                                            ttft if ttft is not None else done - sent, tokens, asked))
        return add

    fleet = {"engines": ENGINES, "running": RUNNING, "waiting": WAITING, "tokens": TOKENS, "decode_ms": DECODE_MS}
    run_virtual(fleet, MeshConfig.model_validate(CONFIG), [(p.rates, p.seconds) for p in phases], deadline_s, record)


CLIENTS = (("heavy",), ("light", "vip"))  # one client process each: the flood's, and the others' (two applications)


def _client(url: str, keys: dict[str, str], phase: Phase, deadline_s: float, seed: int,
            t0: float) -> tuple[list[Result], list[float]]:
    asyncio.run(run_phase(url, keys, phase, deadline_s, seed, t0))
    return phase.results, phase.lag_ms


def _clients(url: str, keys: dict[str, str], phase: Phase, deadline_s: float, seed: int) -> None:
    """Runs the phase from a process per group of ``CLIENTS``, started together: on a small machine
    one client process driving the flood as well would fall behind it (its loop lag was seen at
    hundreds of ms), and the light tenant's timings would measure that client, not the mesh."""
    groups = [Phase(phase.name, {t: phase.rates[t] for t in group if t in phase.rates}, phase.seconds)
              for group in CLIENTS]
    groups = [g for g in groups if g.rates]
    t0 = time.perf_counter() + 1.0  # every process has started by then
    with ProcessPoolExecutor(len(groups), mp_context=multiprocessing.get_context("fork")) as pool:
        runs = [pool.submit(_client, url, keys, g, deadline_s, seed * 10 + k, t0) for k, g in enumerate(groups)]
        for run in runs:
            results, lag = run.result()
            phase.results += results
            phase.lag_ms += lag


def _access_log(log: Path, offset: int, began: float) -> list[tuple[str, float, float]]:
    """The gateway's request records written past ``offset``: (tenant, sent s after ``began`` (a wall
    time), its first byte's ms over 1000: the first token's, or the whole answer's or refusal's)."""
    with log.open("rb") as f:
        f.seek(offset)
        lines = f.read().splitlines()
    out = []
    for line in lines:
        if b'"msg":"request"' in line:
            r = orjson.loads(line)
            took = (r.get("ttft_ms") or r.get("duration_ms") or 0.0) / 1000
            out.append((r.get("tenant", ""), r["ts"] - (r.get("duration_ms") or 0.0) / 1000 - began, took))
    return out


def _mesh(phases: list[Phase], deadline_s: float) -> None:
    with tempfile.TemporaryDirectory(prefix="llmesh-bench-fair-") as tmp:
        mesh, keys = _start_mesh(Path(tmp))
        try:
            url = mesh.layout.http_url + "/v1/chat/completions"
            ok = wait_until(lambda: httpx.post(url, json={"model": MODEL, "max_tokens": 1, "messages": [
                {"role": "user", "content": "hi"}]}, headers={"authorization": f"Bearer {keys['light']}"},
                timeout=10).status_code == 200, 60)
            if not ok:
                raise RuntimeError("the mesh does not answer:\n" + mesh.logs())
            log = mesh.log_dir / "gateway.log"
            for i, phase in enumerate(phases):
                note(f"mesh {phase.name}: {', '.join(f'{t} {r:.1f}/s' for t, r in phase.rates.items())}")
                seen, began = log.stat().st_size, time.time() + 1.0  # _clients' phase begins 1 s from now
                _clients(url, keys, phase, deadline_s, seed=i)
                time.sleep(2)  # what the cut-off left in the engines ends
                phase.gateway = _access_log(log, seen, began)
        finally:
            mesh.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON document on stdout (the default)")
    ap.add_argument("--mode", choices=("both", "mesh", "virtual"), default="both",
                    help="mesh: real processes (figures include this machine's contention); virtual: in process "
                    "on a virtual clock (bench/fairness_virtual.py)")
    ap.add_argument("--loads", default="1.5,3", help="multiples of the engines' saturation")
    ap.add_argument("--seconds", type=float, default=40, help="each loaded phase")
    ap.add_argument("--unloaded-seconds", type=float, default=20)
    ap.add_argument("--warmup", type=float, default=8, help="seconds of each phase left out of its figures")
    ap.add_argument("--deadline", type=float, default=10, help="each request's timeout (x-request-timeout), s")
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    service_s = TOKENS * DECODE_MS / 1000
    saturation = ENGINES * RUNNING / service_s  # requests per second the engines finish at most

    def rates(load: float) -> dict[str, float]:
        total = load * saturation
        return {"heavy": total * 0.9 * 10 / 11, "light": total * 0.9 / 11, "vip": total * 0.1}

    def phases() -> list[Phase]:
        base = rates(loads[0])
        return [Phase("unloaded", {"light": base["light"], "vip": base["vip"]}, args.unloaded_seconds),
                *(Phase(f"load_{x:g}x", rates(x), args.seconds) for x in loads)]

    report: dict = {"setup": {"engines": ENGINES, "running": RUNNING, "waiting": WAITING, "tokens": TOKENS,
                              "decode_ms": DECODE_MS, "saturation_per_s": round(saturation, 1),
                              "deadline_s": args.deadline, "flow_control": CONFIG["flow_control"]}}
    for mode, run in (("virtual", _virtual), ("mesh", _mesh)):
        if args.mode in (mode, "both"):
            note(f"{mode} run")
            done = phases()
            run(done, args.deadline)
            part = {p.name: summary(p, min(args.warmup, p.seconds / 2), args.deadline) for p in done}
            part["goals"] = _goals(part)
            report[mode] = part
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

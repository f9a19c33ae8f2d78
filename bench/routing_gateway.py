"""Issue 32's check through the gateway: do multi-turn follow-ups keep the TTFT of a cached prefix
while the fleet is at 80 % load? (``python -m bench.routing_gateway --json``)

A mesh started as the README does (``llmesh up`` through ``llmesh.testing.Mesh``, ``sim:4``) with a
costly prefill (``PREFILL_MS`` per uncached prompt token: a 600-word system prompt costs ~180 ms),
driven through the HTTP front with the official ``openai`` client, streaming
(``bench.conversation_load``):

1. idle: a lone conversation's first turn (uncached) and then its follow-up alone (its prefix cached):
   TTFT p50 of each over a few repetitions;
2. capacity: closed loops of conversations (a few shared system prompts, 4-6 turns each, each turn
   adding the answer and a new user message to the history), no think time, with users for half, three
   quarters and all of the running slots (engines x max_running): the most turns a second one served is
   the fleet's capacity;
3. 80 % load: turns start by a Poisson process at 80 % of that capacity (``bench.routing``'s
   definition of load: a share of saturation), each the next turn of a free user's conversation. The
   load is measured, not assumed: the turns a second served, the client's in-flight count and the
   engines' reported running counts (the scheduler's table, every 0.2 s). Per turn kind, TTFT
   p50/p90/p99; per follow-up, whether the access log's endpoint for its x-request-id is the one that
   served the previous turn (the engine holding its prefix);
4. the same rate with ``routing: round_robin`` set in live config, for contrast;
5. both policies again under a closed loop at 80 % load (the issue's probe: conversations in flight,
   each user's next turn sent when its last one ends), its users interpolated from step 2's loops.

The JSON's ``ratio`` is follow-up p50 at 80 % (Poisson) over the lone cached-prefix p50; ``goal_met``:
<= 1.3. ``closed_loop`` holds the same for step 5. The two differ in bursts: Poisson starts outrun the
slots now and then, and a turn that waits for a slot waits for a whole request to end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from openai import OpenAI

from bench.common import child_pid, cpu_seconds, note, pct
from bench.conversation_load import MODEL, OUTPUT_TOKENS, Pacer, Turn, Users, loaded, occupancy, system_prompt, turn
from llmesh.testing import Mesh, free_layout, metric_values, wait_until, write_config_file

PREFILL_MS = 0.3        # per uncached prompt token (a sim token is a word)
DECODE_MS = 10.0        # a decode step
GOAL = 1.3
POLICIES = ("prefix_aware", "round_robin")


@dataclass(frozen=True)
class Plan:
    engines: int = 4
    max_running: int = 4
    system_words: int = 600
    prompts: int = 4          # shared system prompts
    turns: tuple[int, int] = (4, 6)
    load: float = 0.8
    duration_s: float = 45.0  # per routing policy
    capacity_s: float = 15.0  # each closed loop that measures the fleet's capacity
    capacity_users: tuple[float, ...] = (0.5, 0.75, 1.0)  # their users, as shares of the slots
    lone_reps: int = 5
    profile: Path | None = None  # a sim profile fitted to a real engine: replaces PREFILL_MS and DECODE_MS
    gpu_steps: bool = False      # the bench's timings, a step lasting the longer of decode and prefill (a GPU's)

    @property
    def slots(self) -> int:
        return self.engines * self.max_running

    @property
    def conversations(self) -> int:
        """bench.routing_replicas' closed-loop users: this share of the running slots."""
        return max(1, round(self.load * self.slots))

    def users(self, count: int, pacer: Pacer | None = None) -> Users:
        return Users(count, self.prompts, self.system_words, self.turns, pacer)


QUICK = Plan(engines=2, max_running=2, system_words=300, prompts=2, turns=(3, 3), duration_s=6.0, capacity_s=3.0,
             capacity_users=(0.5, 1.0), lone_reps=2)


def served_by(log: Path) -> dict[str, dict]:
    """x-request-id -> the gateway's access-log record of it."""
    out = {}
    for line in log.read_text().splitlines():
        if '"msg":"request"' in line:
            rec = json.loads(line)
            if rec.get("request_id") and rec.get("endpoint"):
                out[rec["request_id"]] = rec
    return out


def attach_endpoints(turns: list[Turn], log: Path) -> None:
    wanted = {t.rid for t in turns}
    found: dict[str, dict] = {}

    def all_logged() -> bool:
        found.update(served_by(log))
        return wanted <= found.keys()

    wait_until(all_logged, 10)
    for t in turns:
        rec = found.get(t.rid, {})
        t.endpoint, t.gateway_ttft_ms = rec.get("endpoint", ""), rec.get("ttft_ms")


def lone(client: OpenAI, mesh: Mesh, plan: Plan) -> tuple[list[Turn], list[tuple[float, float]]]:
    """Idle fleet: a conversation's first turn, then its follow-up alone, ``lone_reps`` times; and the
    engines' TTFT totals (seconds, requests) around the follow-ups only."""
    out, totals = [], [(0.0, 0.0), (0.0, 0.0)]
    for rep in range(plan.lone_reps):
        conv = f"lone{rep}"
        messages = [{"role": "system", "content": system_prompt(1000 + rep, plan.system_words)},
                    {"role": "user", "content": f"conversation {conv}: the first question"}]
        rid, ttft, answer = turn(client, messages)
        out.append(Turn(conv, 0, rid, ttft))
        time.sleep(1.0)  # a user reading the answer; the engine's block report arrives meanwhile
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and a follow-up?"}]
        before = engine_ttft_totals(mesh)
        rid, ttft, _ = turn(client, messages)
        after = engine_ttft_totals(mesh)
        out.append(Turn(conv, 1, rid, ttft))
        totals = [(totals[0][0] + before[0], totals[0][1] + before[1]), (totals[1][0] + after[0],
                                                                          totals[1][1] + after[1])]
        time.sleep(0.5)
    return out, totals


def ms(values: list[float], q: float) -> float | None:
    return round(pct(values, q) * 1000, 1) if values else None


def summarize(turns: list[Turn]) -> dict:
    """TTFT percentiles of first turns and follow-ups; follow-ups served where the previous turn was."""
    by_conv: dict[str, dict[int, Turn]] = {}
    for t in turns:
        by_conv.setdefault(t.conv, {})[t.index] = t
    follow = [t for t in turns if t.index > 0]
    first = [t.ttft_s for t in turns if t.index == 0]
    same = [t for t in follow if t.endpoint and t.endpoint == by_conv[t.conv][t.index - 1].endpoint]
    return {"first_turns": len(first), "follow_ups": len(follow),
            "first_ttft_ms": {f"p{q}": ms(first, q) for q in (50, 90, 99)},
            "follow_up_ttft_ms": {f"p{q}": ms([t.ttft_s for t in follow], q) for q in (50, 90, 99)},
            "follow_up_gateway_ttft_ms_p50": ms([t.gateway_ttft_ms / 1000 for t in follow
                                                 if t.gateway_ttft_ms is not None], 50),
            "follow_ups_on_prefix_engine": len(same),
            "follow_up_prefix_hit_rate": round(len(same) / len(follow), 3) if follow else None,
            "turns_per_endpoint": dict(sorted(Counter(t.endpoint for t in turns).items()))}


class CpuWatch:
    """Cores used over a phase by the mesh's processes (the gateway on its own too) and by this
    bench's process (its client threads), and the machine's load average at the end: the shared
    2-core machine's contention, measured."""

    def __init__(self, mesh: Mesh) -> None:
        assert mesh.proc is not None  # started
        self.mesh_pid, self.gateway_pid = mesh.proc.pid, child_pid(mesh.proc.pid, "llmesh.gateway")
        self.start = self._now()

    def _now(self) -> tuple[float, float, float, float]:
        mine = os.times()
        return (time.monotonic(), cpu_seconds(self.mesh_pid), cpu_seconds(self.gateway_pid), mine.user + mine.system)

    def cores(self) -> dict:
        end = self._now()
        wall = end[0] - self.start[0]
        used = [round((b - a) / wall, 2) for a, b in zip(self.start[1:], end[1:])]
        return {"mesh_cores": used[0], "gateway_cores": used[1], "bench_client_cores": used[2],
                "machine_cores": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2)}


def engine_ttft_totals(mesh: Mesh) -> tuple[float, float]:
    """(seconds, requests) summed over the engines' TTFT histograms (their own view: from a
    request's arrival at the engine to its first token)."""
    ports = [port for name, port in mesh.metrics_ports().items() if name.startswith("engine")]
    total = sum(sum(metric_values(p, "vllm:time_to_first_token_seconds_sum")) for p in ports)
    count = sum(sum(metric_values(p, "vllm:time_to_first_token_seconds_count")) for p in ports)
    return total, count


def ttft_split(turns: list[Turn], before: tuple[float, float], after: tuple[float, float]) -> dict:
    """Mean TTFT over every turn of a phase as the client, the gateway and the engines saw it:
    where the time between the client and the engine goes."""
    gateway = [t.gateway_ttft_ms for t in turns if t.gateway_ttft_ms is not None]
    served = after[1] - before[1]
    return {"client_ms": round(statistics.fmean(t.ttft_s for t in turns) * 1000, 1) if turns else None,
            "gateway_ms": round(statistics.fmean(gateway), 1) if gateway else None,
            "engine_ms": round((after[0] - before[0]) / served * 1000, 1) if served else None,
            "engine_requests": int(served)}


def set_routing(mesh: Mesh, config: Path, policy: str) -> None:
    mesh.wait_for_config(write_config_file(config, f"models: {{{MODEL}: {{routing: {policy}}}}}\n"))


def run_phase(client: OpenAI, mesh: Mesh, config: Path, plan: Plan, policy: str, users: Users,
              duration: float) -> dict:
    """``policy`` for ``duration`` seconds of the ``users``' turns."""
    set_routing(mesh, config, policy)
    pacer = users.pacer
    note(f"routing_gateway: {policy}, " + (f"{pacer.rate:.1f} turns/s from " if pacer else "a closed loop of ")
         + f"{users.count} users for {duration:.0f} s")
    watch, engines_before = CpuWatch(mesh), engine_ttft_totals(mesh)
    turns, gauge, per_s = loaded(client, mesh.layout.address("scheduler"), users, duration)
    cpu, engines_after = watch.cores(), engine_ttft_totals(mesh)
    attach_endpoints(turns, mesh.log_dir / "gateway.log")
    paced = {} if pacer is None else {"rate_turns_per_s": round(pacer.rate, 2), "late_starts": pacer.late,
                                      "starts": pacer.started}
    return {"policy": policy, "users": users.count, "turns_per_s": per_s, **paced, **summarize(turns),
            "load": occupancy(gauge, plan.slots), "cpu": cpu, "client_errors": dict(Counter(gauge.errors)),
            "mean_ttft_split": ttft_split(turns, engines_before, engines_after)}


def capacity(client: OpenAI, mesh: Mesh, config: Path, plan: Plan) -> dict:
    """The fleet's capacity under prefix_aware: the most turns a second a closed loop served, with
    users for half, three quarters and all of the running slots (with every slot taken, spilling
    conversations off their prefix's engine can serve fewer than with some slots free)."""
    runs = [run_phase(client, mesh, config, plan, "prefix_aware", plan.users(max(1, round(share * plan.slots))),
                      plan.capacity_s) for share in plan.capacity_users]
    best = max(runs, key=lambda r: r["turns_per_s"])
    return {"turns_per_s": best["turns_per_s"], "users": best["users"], "runs": runs}


def start_mesh(root: Path, plan: Plan) -> tuple[Mesh, Path]:
    config = root / "llmesh.yaml"
    config.write_text(f"models: {{{MODEL}: {{routing: prefix_aware}}}}\n")
    mesh = Mesh(layout=free_layout(n_engines=plan.engines), engines=f"sim:{plan.engines}",
                model_dir=root / "models", log_dir=root / "logs", args=["--no-cache"],
                env={"LLMESH_CONFIG_FILE": str(config), **sim_env(plan)})
    mesh.start(timeout_s=120)
    return mesh, config


def sim_env(plan: Plan) -> dict[str, str]:
    """The sim engines' settings: the plan's slots, the bench's timings or, with ``plan.profile``,
    a profile fitted to a real engine (``llmesh bench engine --calibrate``) in their place."""
    timing = ({"LLMESH_ENGINE_SIM_PROFILE": str(plan.profile.resolve())} if plan.profile is not None else
              {"LLMESH_ENGINE_SIM_PREFILL_MS_PER_TOKEN": str(PREFILL_MS),
               "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": str(DECODE_MS),
               "LLMESH_ENGINE_SIM_PIGGYBACK": str(plan.gpu_steps).lower()})
    return {"LLMESH_ENGINE_MAX_RUNNING": str(plan.max_running), "LLMESH_ENGINE_MAX_WAITING": "256", **timing,
            "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": str(OUTPUT_TOKENS), "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600"}


def fleet(plan: Plan) -> dict:
    timing = ({"sim_profile": json.loads(plan.profile.read_text())} if plan.profile is not None else
              {"sim_prefill_ms_per_token": PREFILL_MS, "sim_decode_ms_per_step": DECODE_MS,
               "sim_piggyback": plan.gpu_steps})
    return {"engines": plan.engines, "max_running": plan.max_running, "slots": plan.slots, **timing,
            "output_tokens": OUTPUT_TOKENS, "system_prompt_words": plan.system_words,
            "shared_system_prompts": plan.prompts, "turns": list(plan.turns)}


def bench(plan: Plan) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mesh, config = start_mesh(Path(tmp), plan)
        try:
            client = OpenAI(base_url=mesh.layout.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
            note("routing_gateway: lone conversations on the idle fleet")
            watch = CpuWatch(mesh)
            idle, totals = lone(client, mesh, plan)
            idle_cpu = watch.cores()
            attach_endpoints(idle, mesh.log_dir / "gateway.log")
            idle_split = ttft_split([t for t in idle if t.index > 0], *totals)
            fleet_capacity = capacity(client, mesh, config, plan)
            rate = plan.load * fleet_capacity["turns_per_s"]
            policies = [run_phase(client, mesh, config, plan, p, plan.users(2 * plan.slots, Pacer(rate)),
                                  plan.duration_s) for p in POLICIES]
            users = closed_users(plan, fleet_capacity)
            closed = [run_phase(client, mesh, config, plan, p, plan.users(users), plan.duration_s) for p in POLICIES]
        finally:
            mesh.stop()
    return report(plan, idle, fleet_capacity, policies, closed) | {"idle_cpu": idle_cpu,
                                                                    "lone_follow_up_mean_ttft_split": idle_split}


def closed_users(plan: Plan, capacity: dict) -> int:
    """The users of a closed loop that serves ``plan.load`` of the fleet's capacity: interpolated
    over the capacity loops' (users, turns a second), from (0, 0)."""
    target = plan.load * capacity["turns_per_s"]
    points = [(0, 0.0)] + sorted((r["users"], r["turns_per_s"]) for r in capacity["runs"])
    for (u0, r0), (u1, r1) in zip(points, points[1:]):
        if r1 >= target > r0:
            return max(1, round(u0 + (u1 - u0) * (target - r0) / (r1 - r0)))
    return capacity["users"]


def lone_summary(plan: Plan, idle: list[Turn], cached_p50: float | None) -> dict:
    both = summarize(idle)
    return {"reps": plan.lone_reps, "uncached_first_ttft_ms_p50": both["first_ttft_ms"]["p50"],
            "cached_follow_up_ttft_ms_p50": cached_p50,
            "cached_follow_up_gateway_ttft_ms_p50": both["follow_up_gateway_ttft_ms_p50"],
            "follow_ups": both["follow_ups"], "follow_ups_on_prefix_engine": both["follow_ups_on_prefix_engine"]}


def check(lone_cached: float | None, capacity: dict, runs: list[dict]) -> dict:
    """The check under one arrival model: each policy's phase and its share of the capacity, and
    the first's (prefix_aware's) follow-up TTFT p50 over a lone cached follow-up's."""
    at_load = runs[0]["follow_up_ttft_ms"]["p50"]
    ratio = round(at_load / lone_cached, 2) if lone_cached and at_load else None
    return {"load_share": {r["policy"]: round(r["turns_per_s"] / capacity["turns_per_s"], 3) for r in runs},
            "loaded": {r["policy"]: r for r in runs}, "ratio": ratio, "goal_met": ratio is not None and ratio <= GOAL}


def report(plan: Plan, idle: list[Turn], capacity: dict, policies: list[dict], closed: list[dict]) -> dict:
    """Poisson starts' check at the top level; ``closed_loop`` the same under a closed loop (the
    issue's probe: conversations in flight, each user's next turn sent when its last one ends)."""
    lone_cached = ms([t.ttft_s for t in idle if t.index > 0], 50)
    return {"bench": "routing_gateway", "model": MODEL, "fleet": fleet(plan),
            "target_load": plan.load, "duration_s": plan.duration_s, "lone": lone_summary(plan, idle, lone_cached),
            "capacity": capacity, **check(lone_cached, capacity, policies), "goal": GOAL,
            "closed_loop": {"users": closed[0]["users"], **check(lone_cached, capacity, closed)}}


def plan_from_args(prog: str, description: str, argv: list[str] | None, per: str) -> Plan:
    """The command line of a bench that runs a Plan (this one and bench.routing_replicas):
    ``--quick`` for QUICK, ``--duration`` seconds of load ``per`` run, ``--profile`` a sim profile."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--json", action="store_true", help="print the JSON document only (the default prints it too)")
    ap.add_argument("--quick", action="store_true", help="a tiny run (2 engines, seconds): for tests")
    ap.add_argument("--duration", type=float, help=f"seconds of load per {per}")
    ap.add_argument("--profile", type=Path, help="the engines' timings from a profile fitted to a real engine "
                    "(`llmesh bench engine --calibrate FILE`) instead of the bench's own")
    ap.add_argument("--gpu-steps", action="store_true", help="the bench's timings as a GPU steps: a step lasts the "
                    "longer of its decode and its prefill (the default adds them, as llama.cpp on CPUs does)")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    if args.profile is not None and not args.profile.is_file():
        ap.error(f"no sim profile at {args.profile}")
    if args.profile is not None and args.gpu_steps:
        ap.error("--gpu-steps sets the bench's own timings; a --profile replaces them")
    return replace(plan, **({"duration_s": args.duration} if args.duration else {}), profile=args.profile,
                   gpu_steps=args.gpu_steps)


def main(argv: list[str] | None = None) -> None:
    plan = plan_from_args("python -m bench.routing_gateway", __doc__.split("\n")[0], argv, "routing policy")
    print(json.dumps(bench(plan), indent=2))


if __name__ == "__main__":
    main()

"""The routing sweep behind ``python -m bench.routing``: every generated workload
(``bench.routing_workloads``) at fractions of the best baseline's saturation, for each
policy, on a fleet of sim engines on a virtual clock (``bench.virtual_time``) with the
gateway's real picker.

What the scheduler stream carries reaches the picker every ``report_s``, ``lag_s`` late
(engines' own metrics lag real queue state by seconds): each engine's running and waiting
requests and its KV block events. The picker's load ledger (uncached prompt tokens sent and
not yet started, decoding sequences) is exact; a policy named ``<name>/noledger`` routes on
the reports alone, to measure what the ledger buys against report lag.

Policies: round_robin, least_loaded, llmd_sticky (our re-implementation of llm-d's
sticky-until-saturated: prefix affinity >= 0.8 unless the endpoint's prefill queue exceeds
the best one's by a penalty = the calibrated peak prefill tokens/s x ``sticky_bound_s``, then
token load), dynamo_kv (our re-implementation of a Dynamo-style KV router cost: overlap-
weighted prefill blocks + active decode blocks, lowest wins), prefix_aware (llmesh's), and
prefix_oracle (prefix_aware reading every engine's exact cache and load at each pick)."""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from llmesh.engine.backends.base import DecodeParams
from llmesh.engine.backends.sim import SimBackend, SimProfile
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker, PickInput
from llmesh.prompt_tokens import sim_chat_words, sim_token
from llmesh.types import Message
from bench.common import note, pct
from bench.saturation import highest
from bench.routing_workloads import Sessions, poisson_starts
from bench.virtual_time import VirtualTimeLoop

MODEL = "sim-bench"
POLICIES = ("round_robin", "least_loaded", "llmd_sticky", "dynamo_kv", "prefix_aware", "prefix_aware_v1",
            "prefix_oracle")
SUSTAINED = 0.98
# max_batch: vLLM's default max_num_seqs for its OpenAI server (256; 1024 on GPUs of 70 GiB or more), so
# that KV room bounds an engine's batch, as it does there
PROFILE = SimProfile(prefill_ms_per_token=0.1, decode_ms_base=15.0, decode_ms_per_seq=0.3, kv_blocks=4096,
                     max_batch=256, output_tokens=1024)


@dataclass
class Setup:
    engines: int = 4
    report_s: float = 0.5
    lag_s: float = 0.0
    duration_s: float = 40.0
    seed: int = 7
    sticky_penalty_tokens: int = 2048
    users: int = 0  # > 0: a closed loop of this many users instead of Poisson session starts


def apply_kv_events(picker: EndpointPicker, eid: str, events: Iterable) -> None:
    """A sim engine's KV events (``kv_blocks.take_events()``) into the picker's view of ``eid``'s
    blocks, as the scheduler's stream brings them to a gateway."""
    for ev in events:
        if ev.kind == "cleared":
            picker.kv.apply(eid, True, (), ())
        elif ev.kind == "stored":
            picker.kv.apply(eid, False, ev.hashes, ())
        elif ev.kind == "removed":
            picker.kv.apply(eid, False, (), ev.hashes)

class Tokenizer:
    """The sim engines' tokenizer (``sim_chat_words``: the prompt ends in the answer's header, so a
    follow-up can hit the blocks its previous answer filled), remembering words it has seen."""

    def __init__(self) -> None:
        self._known: dict[str, int] = {}

    def __call__(self, messages: list[Message]) -> list[int]:
        known, out = self._known, []
        for w in sim_chat_words(messages):
            t = known.get(w)
            if t is None:
                t = known[w] = sim_token(w)
            out.append(t)
        return out


class Fleet:
    """The engines, the gateway's picker and the (lagging) reports it gets. ``sent``, when a
    list: each request's (arrival, prompt tokens, max_tokens), for Dynamo's replay."""

    sent: list[tuple[float, list[int], int]] | None = None

    def __init__(self, engines: dict[str, SimBackend], policy: str, setup: Setup, profile: SimProfile):
        self.engines, self.setup, self.profile = engines, setup, profile
        self.routing, _, variant = policy.partition("/")
        self.ledger = variant != "noledger"
        self.oracle = self.routing == "prefix_oracle"
        self.picker = EndpointPicker(random.Random(0), sticky_penalty_tokens=setup.sticky_penalty_tokens)
        self.waiting: Counter[str] = Counter()   # sent, no first chunk yet
        self.running: Counter[str] = Counter()   # first chunk seen, not ended
        self.served: Counter[str] = Counter()
        self.tokenize = Tokenizer()
        self._deliver(self._snapshot())

    def _snapshot(self) -> tuple[list[Endpoint], list[tuple[str, list]]]:
        mb = self.profile.max_batch
        eps = [Endpoint(eid, eid, frozenset({MODEL}), running=self.running[eid], waiting=self.waiting[eid],
                        max_running=mb, kv_hash=b.kv_blocks.scheme) for eid, b in self.engines.items()]
        return eps, [(eid, b.kv_blocks.take_events()) for eid, b in self.engines.items()]

    def _deliver(self, snap: tuple[list[Endpoint], list[tuple[str, list]]]) -> None:
        eps, events = snap
        self.picker.replace_all(eps)
        for eid, evs in events:
            apply_kv_events(self.picker, eid, evs)

    async def reporter(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.setup.report_s)
            snap = self._snapshot()
            if self.setup.lag_s > 0:
                loop.call_later(self.setup.lag_s, self._deliver, snap)
            else:
                self._deliver(snap)

    async def serve(self, history: list[Message], max_tokens: int) -> tuple[float, str]:
        """One request: its TTFT and its answer."""
        loop = asyncio.get_running_loop()
        tokens = self.tokenize(history)
        if self.sent is not None:
            self.sent.append((loop.time(), tokens, max_tokens))
        if self.oracle:
            self._deliver(self._snapshot())  # the exact cache and load of every engine, right now
        routing = "prefix_aware" if self.oracle else self.routing
        pick = PickInput(MODEL, loop.time(), work_tokens=len(tokens) + max_tokens, tokens=lambda: tokens,
                         max_tokens=max_tokens)  # as the gateway's pick carries the request's
        eid = self.picker.pick(pick, routing).endpoint_id
        ticket = self.picker.acquire(eid, pick.work_tokens, pick) if self.ledger else None
        self.waiting[eid] += 1
        started, ttft, parts = loop.time(), None, []
        try:
            async for piece in self.engines[eid].stream(tokens, DecodeParams(max_tokens, 0.0, 1.0, 0)):
                if ttft is None:
                    ttft = loop.time() - started
                    self.waiting[eid] -= 1
                    self.running[eid] += 1
                    if ticket is not None:
                        self.picker.started(ticket)
                parts.append(piece)
        finally:
            if ttft is None:
                self.waiting[eid] -= 1
            else:
                self.running[eid] -= 1
            if ticket is not None:
                self.picker.release(eid, pick.work_tokens, ticket)
        self.served[eid] += 1
        return ttft or 0.0, "".join(p if isinstance(p, str) else p.text for p in parts)

    def hit_rate(self) -> float:
        q = h = 0
        for backend in self.engines.values():
            queries, hits = backend.prefix_cache_stats()
            q, h = q + queries, h + hits
        return h / q if q else 0.0


class Tally:
    """What a run measured: each request's arrival, end, TTFT and tokens; each session's start and end."""

    def __init__(self) -> None:
        self.arrived: list[float] = []
        self.finished: list[float] = []
        self.started: list[float] = []   # sessions
        self.ended: list[float] = []
        self.ttfts: list[float] = []
        self.input_tokens: list[tuple[float, int]] = []


async def _session(fleet: Fleet, sessions: Sessions, n: int, tally: Tally) -> None:
    loop = asyncio.get_running_loop()
    history: list[Message] = []
    think = random.Random(n)
    tally.started.append(loop.time())
    for k, turn in enumerate(sessions.session(n)):
        if k:
            await asyncio.sleep(think.expovariate(1 / sessions.think_s))
        history += turn.messages
        tally.arrived.append(loop.time())
        ttft, answer = await fleet.serve(history, turn.max_tokens)
        tally.finished.append(loop.time())
        tally.ttfts.append(ttft)
        tally.input_tokens.append((loop.time(), sum(len(m.content.split()) + 1 for m in history)))
        history.append(Message("assistant", answer))  # as a chat client sends it back
    tally.ended.append(loop.time())


async def _drive(fleet: Fleet, sessions: Sessions, rate: float, duration_s: float, setup: Setup,
                 tally: Tally) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    if setup.users:  # closed loop: each user starts its next session when its last ends
        counter = iter(range(1 << 30))

        async def user() -> None:
            while loop.time() - t0 < duration_s:
                await _session(fleet, sessions, next(counter), tally)
        await asyncio.gather(*(user() for _ in range(setup.users)))
        return
    tasks = []
    for n, at in enumerate(poisson_starts(rate, duration_s, setup.seed)):
        await asyncio.sleep(max(0.0, t0 + at - loop.time()))
        tasks.append(asyncio.create_task(_session(fleet, sessions, n, tally)))
    await asyncio.gather(*tasks)


def keeps_up(came: int, done: int) -> bool:
    """Requests finished over a window keep up with those that arrived in it: 98 %, less two
    standard deviations of a Poisson count (a short window's noise is no backlog)."""
    return done >= SUSTAINED * came - 2 * math.sqrt(came)


async def run_one(sessions: Sessions, policy: str, rate: float, setup: Setup, profile: SimProfile,
                  sent: list | None = None, ttfts: list[float] | None = None) -> dict:
    """One policy at one rate (sessions started per second; ignored for a closed loop), for
    ``setup.duration_s`` times the workload's ``window``.
    Throughput and ``sustained`` are measured over the second half of the window: sustained
    while the requests finished there keep up with those that arrived, and the sessions ended
    there with those started (``keeps_up``). A session's next turn arrives only when its last
    ends, so a fleet falling behind slows its own arrivals; sessions still in progress pile up."""
    loop = asyncio.get_running_loop()
    engines = {f"engine-{i}": SimBackend(MODEL, 1 << 17, profile) for i in range(setup.engines)}
    fleet = Fleet(engines, policy, setup, profile)
    fleet.sent = sent
    reporter = asyncio.create_task(fleet.reporter())
    tally, t0, duration = Tally(), loop.time(), setup.duration_s * sessions.window
    try:
        await _drive(fleet, sessions, rate, duration, setup, tally)
    finally:
        reporter.cancel()
        for backend in engines.values():
            await backend.close()
    lo, hi = t0 + duration / 2, t0 + duration
    came = sum(lo <= t < hi for t in tally.arrived)
    done = sum(lo <= t < hi for t in tally.finished)
    began = sum(lo <= t < hi for t in tally.started)
    ended = sum(lo <= t < hi for t in tally.ended)
    served = [fleet.served[e] for e in engines] or [0]
    if ttfts is not None:
        ttfts.extend(tally.ttfts)
    return {"workload": sessions.name, "policy": policy, "rate_sessions_per_s": round(rate, 3), "window_s": duration,
            "requests": len(tally.ttfts),
            "ttft_ms_p50": round(pct(tally.ttfts, 50) * 1000, 1), "ttft_ms_p99": round(pct(tally.ttfts, 99) * 1000, 1),
            "throughput_req_s": round(done / (hi - lo), 2), "offered_req_s": round(came / (hi - lo), 2),
            "input_tokens_s": round(sum(n for t, n in tally.input_tokens if lo <= t < hi) / (hi - lo)),
            "sessions_started": began, "sessions_ended": ended,
            "sustained": keeps_up(came, done) and keeps_up(began, ended), "kv_hit_rate": round(fleet.hit_rate(), 3),
            "load_imbalance_max_over_mean": round(max(served) / max(sum(served) / len(served), 1e-9), 2)}


def run_sim(sessions: Sessions, policy: str, rate: float, setup: Setup, profile: SimProfile = PROFILE,
            sent: list | None = None, ttfts: list[float] | None = None) -> dict:
    """``sent``: a list to record each request in (arrival s from the run's start, tokens, max_tokens);
    ``ttfts``: a list to add each request's TTFT (seconds) to."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        out = runner.run(run_one(sessions, policy, rate, setup, profile, sent, ttfts))
    if sent:
        t0 = sent[0][0]
        sent[:] = [(t - t0, tokens, m) for t, tokens, m in sent]
    return out


def calibrate_prefill(profile: SimProfile = PROFILE, prompt_tokens: int = 2000) -> float:
    """Peak prefill throughput (prompt tokens a second) of one idle engine: a full batch of
    distinct prompts sent at once, timed to their last first token."""
    async def main() -> float:
        loop = asyncio.get_running_loop()
        engine = SimBackend(MODEL, 1 << 17, profile)
        batch = max(min(profile.max_batch, profile.kv_blocks * profile.block_size // (prompt_tokens + 16)), 1)
        t0, firsts = loop.time(), []

        async def one(n: int) -> None:
            rng = random.Random(n)
            async for _ in engine.stream([rng.randrange(1 << 15) for _ in range(prompt_tokens)],
                                         DecodeParams(1, 0.0, 1.0, 0)):
                firsts.append(loop.time())
                break
        await asyncio.gather(*(one(n) for n in range(batch)))
        await engine.close()
        return batch * prompt_tokens / (max(firsts) - t0)
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main())


def find_saturation(sessions: Sessions, policy: str, setup: Setup, start: float, bisect: int,
                    profile: SimProfile = PROFILE) -> dict:
    """The highest session rate ``policy`` sustains (``bench.saturation.highest``: grow by
    half until a run is not sustained, then bisect)."""
    def probe(rate: float) -> tuple[bool, dict]:
        r = run_sim(sessions, policy, rate, setup, profile)
        return r["sustained"], r

    try:
        _, lo, probes = highest(probe, start, bisect, floor=0.005)
    except RuntimeError as exc:
        raise SystemExit(f"{policy} on {sessions.name}: no saturation found ({exc})") from None
    note(f"saturation {sessions.name:<14} {policy:<13} {lo['rate_sessions_per_s']:7.3f} sessions/s "
         f"{lo['throughput_req_s']} req/s ({probes} runs)")
    return {"policy": policy, "rate_sessions_per_s": lo["rate_sessions_per_s"],
            "throughput_req_s": lo["throughput_req_s"]}

"""``llmesh bench routing --json``: routing policies compared on one fleet of sim
engines under the same arrivals.

In one process: N real sim engine backends (the engine's own timing model, batching
and KV block ledger, prefix cache with LRU eviction) and the gateway's real picker,
on a virtual clock (``bench.virtual_time``): the engines' steps take their simulated
time however long the CPU takes to run them, so the fleet, not the bench, saturates.
Without ``--rates`` the bench first searches for saturation (the highest rate at
which the best baseline's throughput keeps up with arrivals) and runs at ``--loads``
of it. ``--backend llamacpp`` runs real llama.cpp engines (the real model) instead,
in real time.
What the scheduler stream carries reaches the picker as it does in the mesh: every
``--report-s`` each engine's load and KV block events (a report's delay included).
Per-request gRPC hops are left out: they are the same for every policy.

Workload (seeded): tenants with their own long system prompt run multi-turn chats
whose history grows by each answer, plus document Q&A over a few long shared
documents; conversations start by a Poisson process, follow-up turns after a short
think time. ``--no-sharing`` gives every request a prompt of its own (the control).

Policies: round_robin, least_loaded, sglang_approx (SGLang's cache-aware router as
its docs describe it: per-worker prefix index of the request *text* it sent, no KV
events; shortest queue when loads are imbalanced beyond both balance thresholds,
else the best match above the cache threshold, else the worker with the smallest
index; its index here is 64-character chained chunks rather than a character radix
tree, so matches are rounded down to a chunk), prefix_aware, and prefix_oracle (the
same scorer reading every engine's cache exactly at each pick: the ceiling)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker, PickInput
from llmesh.kvhash import LLMESH_SCHEME, chain_hashes
from bench.routing_sweep import apply_kv_events
from llmesh.types import Message, Prompt
from llmesh.engine.backends.base import DecodeParams
from llmesh.engine.backends.sim import SimBackend, SimProfile
from bench.common import note, pct
from bench.saturation import highest
from bench.routing_field import field_args
from bench.virtual_time import VirtualTimeLoop

MODEL = "sim-bench"
POLICIES = ("round_robin", "least_loaded", "sglang_approx", "prefix_aware", "prefix_oracle")
SUSTAINED = 0.98  # a rate is sustained while this share of the requests arriving finish as fast
CHUNK = 64  # characters per node of the approximate router's per-worker prefix index


def words(rng: random.Random, tag: str, n: int) -> str:
    return " ".join(f"{tag}{rng.randrange(5000)}" for _ in range(n))


class Workload:
    """Conversation scripts, fixed by the seed so every policy sees the same ones."""

    def __init__(self, seed: int, tenants: int, docs: int, sharing: bool, system_words: int = 300,
                 doc_words: int = 900, question_words: int = 30):
        rng = random.Random(seed)
        self.systems = [words(rng, f"t{t}s", system_words) for t in range(tenants)]
        self.docs = [words(rng, f"d{d}w", doc_words) for d in range(docs)]
        self.system_words = system_words
        self.question_words = question_words  # a first question; later ones and questions on documents: 2/3
        self.sharing = sharing
        self.seed = seed

    @property
    def short(self) -> int:
        return max(self.question_words * 2 // 3, 1)

    def conversation(self, n: int) -> list[list[Message]]:
        """The user turns of conversation ``n``: (system, first user message), then follow-ups."""
        rng = random.Random(self.seed * 1_000_003 + n)
        if not self.sharing:
            return [[Message("system", words(rng, f"u{n}x", self.system_words)),
                     Message("user", words(rng, "q", self.question_words))]]
        if rng.random() < 0.3:  # document Q&A: one question over a shared document
            doc = rng.choice(self.docs)
            return [[Message("system", "answer from the document"), Message("user", doc + " question: "
                                                                             + words(rng, "q", self.short))]]
        system = rng.choice(self.systems)
        turns = [[Message("system", system), Message("user", words(rng, "q", self.question_words))]]
        turns += [[Message("user", words(rng, "f", self.short))] for _ in range(rng.randrange(1, 4))]
        return turns


class SglangApprox:
    """SGLang's approximate cache-aware choice (defaults of its gateway: cache threshold
    0.3, balance thresholds 64 absolute and 1.5 relative)."""

    def __init__(self, workers: list[str], cache_threshold=0.3, balance_abs=64, balance_rel=1.5,
                 max_chunks: int = 1 << 18):
        self._trees: dict[str, dict[int, None]] = {w: {} for w in workers}
        self._cache, self._abs, self._rel, self._max = cache_threshold, balance_abs, balance_rel, max_chunks

    @staticmethod
    def chunks(text: str) -> list[int]:
        out, parent = [], 0
        for i in range(0, len(text) - CHUNK + 1, CHUNK):
            parent = hash((parent, text[i:i + CHUNK]))
            out.append(parent)
        return out

    def choose(self, text: str, loads: dict[str, int]) -> str:
        lo, hi = min(loads.values()), max(loads.values())
        chunks = self.chunks(text)
        if hi - lo > self._abs and hi > lo * self._rel:
            worker = min(loads, key=loads.get)
        else:
            def matched(w: str) -> int:
                tree, n = self._trees[w], 0
                while n < len(chunks) and chunks[n] in tree:
                    n += 1
                return n
            best = max(self._trees, key=matched)
            rate = matched(best) * CHUNK / max(len(text), 1)
            worker = best if rate > self._cache else min(self._trees, key=lambda w: len(self._trees[w]))
        tree = self._trees[worker]
        for c in chunks:
            tree.pop(c, None)
            tree[c] = None  # most recently used last
        while len(tree) > self._max:
            del tree[next(iter(tree))]
        return worker


class Fleet:
    """The engines, the gateway's picker and what the scheduler stream tells it."""

    def __init__(self, engines: dict, policy: str, report_s: float, max_batch: int):
        self.engines = engines
        self.inflight = Counter()
        self.served = Counter()
        self.picker = EndpointPicker(random.Random(0))
        self.policy = policy
        self.report_s = report_s
        self.max_batch = max_batch
        self.sglang = SglangApprox(list(self.engines)) if policy == "sglang_approx" else None
        self._report()

    def _report(self) -> None:
        """What the scheduler stream brings: every engine's load and its KV block changes."""
        self.picker.replace_all(Endpoint(eid, eid, frozenset({MODEL}), running=min(n, self.max_batch),
                                         waiting=max(n - self.max_batch, 0), max_running=self.max_batch,
                                         kv_hash=self.engines[eid].kv_blocks.scheme)
                                for eid in self.engines for n in (self.inflight[eid],))
        for eid, backend in self.engines.items():
            apply_kv_events(self.picker, eid, backend.kv_blocks.take_events())

    async def reporter(self) -> None:
        while True:
            await asyncio.sleep(self.report_s)
            self._report()

    async def serve(self, messages: list[Message], max_tokens: int) -> tuple[float, str]:
        loop = asyncio.get_running_loop()
        prompt = Prompt(messages=tuple(messages))
        tokens = next(iter(self.engines.values())).tokenize(prompt)  # the gateway's tokenizer is the engines'
        if self.policy == "prefix_oracle":
            self._report()  # the exact cache of every engine, right now
        routing = "prefix_aware" if self.policy == "prefix_oracle" else self.policy
        pick = PickInput(MODEL, loop.time(), work_tokens=len(tokens) + max_tokens, tokens=lambda: tokens)
        if self.sglang is not None:
            text = "".join(f"{m.role}: {m.content}\n" for m in messages)
            eid = self.sglang.choose(text, {e: self.inflight[e] for e in self.engines})
        else:
            eid = self.picker.pick(pick, routing).endpoint_id
        self.inflight[eid] += 1
        self.picker.acquire(eid, pick.work_tokens)
        started, ttft, parts = loop.time(), None, []
        try:
            async for piece in self.engines[eid].stream(tokens, DecodeParams(max_tokens, 0.0, 1.0, 0)):
                if ttft is None:
                    ttft = loop.time() - started
                parts.append(piece)
        finally:
            self.inflight[eid] -= 1
            self.picker.release(eid, pick.work_tokens)
        self.served[eid] += 1
        return ttft, "".join(parts)

    def hit_rate(self) -> float:
        q = h = 0
        for backend in self.engines.values():
            queries, hits = backend.prefix_cache_stats()
            q, h = q + queries, h + hits
        return h / q if q else 0.0


def sim_engines(n: int, profile: SimProfile) -> dict:
    return {f"engine-{i}": SimBackend(MODEL, 1 << 16, profile) for i in range(n)}


async def run_one(args, workload: Workload, policy: str, rate: float, engines: dict, max_batch: int) -> dict:
    """One policy at one rate. Times are the running loop's: real on a real loop, the
    simulated engines' own on a ``VirtualTimeLoop``. Throughput and ``sustained`` are
    measured over the second half of the arrival window (the fleet warmed up): the
    requests finished there per second, and that over the requests that arrived there."""
    loop = asyncio.get_running_loop()
    fleet = Fleet(engines, policy, args.report_s, max_batch)
    reporter = asyncio.create_task(fleet.reporter())
    rng = random.Random(args.seed)
    ttfts: list[float] = []
    arrived: list[float] = []
    finished: list[float] = []
    tokens = 0

    async def conversation(n: int) -> None:
        nonlocal tokens
        history: list[Message] = []
        think = random.Random(n)
        for turn in workload.conversation(n):
            history += turn
            arrived.append(loop.time())
            ttft, answer = await fleet.serve(history, args.max_tokens)
            finished.append(loop.time())
            ttfts.append(ttft)
            tokens += len(answer.split())
            history.append(Message("assistant", answer))
            await asyncio.sleep(think.expovariate(1 / args.think_s))

    started = loop.time()
    tasks, n, at = [], 0, 0.0
    while True:
        at += rng.expovariate(rate)
        if at > args.duration_s:
            break
        await asyncio.sleep(max(0.0, started + at - loop.time()))
        tasks.append(asyncio.create_task(conversation(n)))
        n += 1
    await asyncio.gather(*tasks)
    elapsed = loop.time() - started
    reporter.cancel()
    for backend in engines.values():
        await backend.close()
    lo, hi = started + args.duration_s / 2, started + args.duration_s
    came = sum(lo <= t < hi for t in arrived)
    done = sum(lo <= t < hi for t in finished)
    served = [fleet.served[eid] for eid in fleet.engines]
    return {"policy": policy, "rate_conversations_per_s": round(rate, 3), "requests": len(ttfts),
            "ttft_ms_p50": round(pct(ttfts, 50) * 1000, 1), "ttft_ms_p99": round(pct(ttfts, 99) * 1000, 1),
            "throughput_req_s": round(done / (hi - lo), 2), "offered_req_s": round(came / (hi - lo), 2),
            "sustained": done >= SUSTAINED * came, "output_tokens_s": round(tokens / elapsed, 1),
            "kv_hit_rate": round(fleet.hit_rate(), 3),
            "load_imbalance_max_over_mean": round(max(served) / (sum(served) / len(served)), 2)}


def run_sim(args, workload: Workload, policy: str, rate: float, profile: SimProfile) -> dict:
    """A run of sim engines on a virtual clock: the bench's own CPU never slows the fleet."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(run_one(args, workload, policy, rate, sim_engines(args.engines, profile),
                                  profile.max_batch))


def find_saturation(args, workload: Workload, profile: SimProfile, policy: str) -> dict:
    """The highest rate ``policy`` sustains (fewer requests finish than arrive past it), by
    ``bench.saturation.highest``: rates grow by half until a run is not sustained, then
    bisection between the last sustained rate and the first that was not."""
    probes: list[dict] = []

    def probe(rate: float) -> tuple[bool, dict]:
        r = run_sim(args, workload, policy, rate, profile)
        probes.append(r)
        note(f"saturation {policy:<14} {rate:7.2f} conv/s: {r['throughput_req_s']} of {r['offered_req_s']} req/s "
             f"p99 {r['ttft_ms_p99']} ms")
        return r["sustained"], r

    try:
        _, lo, _ = highest(probe, args.start_rate, args.bisect, floor=0.01)
    except RuntimeError as exc:
        raise SystemExit(f"{policy}: no saturation found ({exc}); is the profile right?") from None
    return {"policy": policy, "rate_conversations_per_s": lo["rate_conversations_per_s"],
            "throughput_req_s": lo["throughput_req_s"],
            "probes": [{k: p[k] for k in ("rate_conversations_per_s", "throughput_req_s", "offered_req_s",
                                          "ttft_ms_p99")} for p in probes]}


def picking_costs(engines: int, blocks: int = 100_000, prompt_tokens: int = 2048) -> dict:
    """What prefix-aware picking costs a gateway: memory for ``blocks`` cached blocks per
    engine, and per request the block hashes of a prompt and the prefix scoring."""
    import tracemalloc
    from llmesh.gateway.upstream.picking.kvview import KvView
    rng = random.Random(1)
    tracemalloc.start()
    kv = KvView()
    for e in range(engines):
        kv.apply(f"engine-{e}", True, (rng.getrandbits(64) for _ in range(blocks)), ())
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    tokens = [rng.randrange(50_000) for _ in range(prompt_tokens)]
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        hashes = chain_hashes(tokens)
    t1 = time.perf_counter()
    picker = EndpointPicker()
    picker.kv.apply("engine-0", True, hashes, ())
    picker.replace_all(Endpoint(f"engine-{e}", "", frozenset({MODEL}), kv_hash=LLMESH_SCHEME) for e in range(engines))
    for e in range(engines):
        picker.kv.apply(f"engine-{e}", True, hashes[:e * 16], ())
    t2 = time.perf_counter()
    for _ in range(n):
        picker.pick(PickInput(MODEL, 0.0, tokens=lambda: tokens), "prefix_aware")
    t3 = time.perf_counter()
    return {"kv_view_mb_per_engine_at_100k_blocks": round(mem / engines / 2**20, 1),
            f"block_hashes_us_per_{prompt_tokens}_token_prompt": round((t1 - t0) / n * 1e6, 1),
            f"prefix_aware_pick_us_{engines}_engines": round((t3 - t2) / n * 1e6, 1)}


def llamacpp_results(args, workload: Workload, policies: list[str]) -> list[dict]:
    """Each policy once, at ``--rates``, on fresh llama.cpp engines with the real model, in real time."""
    from llmesh.engine.backends.llamacpp import LlamaCppBackend

    results = []
    for rate in (float(r) for r in args.rates.split(",")):
        for policy in policies:
            engines = {f"engine-{i}": LlamaCppBackend.from_store(args.model_dir, args.model, n_ctx=args.n_ctx,
                                                                 n_threads=args.threads, n_batch=512,
                                                                 n_slots=args.slots)
                       for i in range(args.engines)}
            r = asyncio.run(run_one(args, workload, policy, rate, engines, args.slots))
            note(f"{rate:>5} conv/s {policy:<14} ttft p50 {r['ttft_ms_p50']} ms p99 {r['ttft_ms_p99']} ms "
                 f"hit {r['kv_hit_rate']}")
            results.append(r)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("sim", "llamacpp"), default="sim",
                    help="sim: engines on a virtual clock; llamacpp: the real model, in real time")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--rates", help="conversations started per second, comma-separated (skips the saturation "
                                    "search; needed with --backend llamacpp)")
    ap.add_argument("--loads", help="rates to run as fractions of the saturation rate the search finds "
                                    "(default 0.5,0.8,1.0; --legacy-chat: 0.4,0.6,0.8,1.0)")
    ap.add_argument("--saturation-policies", default="round_robin,least_loaded,sglang_approx",
                    help="saturation is the highest rate any of these sustains (the best baseline's)")
    ap.add_argument("--start-rate", type=float, default=4.0, help="the saturation search's first rate")
    ap.add_argument("--bisect", type=int, help="bisection steps of the saturation search (default 3; legacy 4)")
    ap.add_argument("--duration-s", type=float, help="arrivals for this long, per run (default 40; legacy 60)")
    ap.add_argument("--policies", help="comma-separated (default: every policy of the sweep, or of --legacy-chat)")
    ap.add_argument("--profile", type=Path, help="a sim profile from `llmesh bench engine --calibrate`")
    ap.add_argument("--report-s", type=float, default=0.5, help="engine report interval (the picker's lag)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--tenants", type=int, default=6, help="tenants, each with its own system prompt")
    ap.add_argument("--docs", type=int, default=4, help="shared documents")
    ap.add_argument("--system-words", type=int, default=300, help="words in each tenant's system prompt")
    ap.add_argument("--doc-words", type=int, default=900, help="words in each shared document")
    ap.add_argument("--question-words", type=int, default=30, help="words in a first question (others: 2/3)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-sharing", action="store_true", help="every prompt its own (the no-sharing control)")
    ap.add_argument("--model-dir", type=Path, default=Path("var/models"), help="llamacpp: the model store")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="llamacpp: the GGUF model")
    ap.add_argument("--slots", type=int, default=4, help="llamacpp: sequences each engine runs at once")
    ap.add_argument("--threads", type=int, default=1, help="llamacpp: threads per engine")
    ap.add_argument("--n-ctx", type=int, default=4096, help="llamacpp: context per sequence")
    ap.add_argument("--json", action="store_true", help="JSON only (the default prints JSON too)")
    ap.add_argument("--costs-only", action="store_true", help="only the per-request and memory costs")
    ap.add_argument("--legacy-chat", action="store_true",
                    help="the earlier single chat workload (tenants + documents) instead of the field's workloads")
    field_args(ap)
    args = ap.parse_args()
    if not args.legacy_chat and args.backend == "sim" and not args.costs_only:
        from bench.routing_field import run_field
        print(json.dumps(run_field(args), indent=2))
        return
    policies = (args.policies or ",".join(POLICIES)).split(",")
    args.loads = args.loads or "0.4,0.6,0.8,1.0"
    args.bisect = 4 if args.bisect is None else args.bisect
    args.duration_s = args.duration_s or 60.0
    for policy in policies + args.saturation_policies.split(","):
        if policy not in POLICIES:
            raise SystemExit(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
    profile = (SimProfile.load(args.profile) if args.profile else
               SimProfile(prefill_ms_per_token=1.0, decode_ms_base=10.0, decode_ms_per_seq=0.5, kv_blocks=1024,
                          max_batch=16, output_tokens=args.max_tokens))
    costs = picking_costs(args.engines)
    if args.costs_only:
        print(json.dumps({"bench": "routing", "costs": costs}, indent=2))
        return
    workload = Workload(args.seed, tenants=args.tenants, docs=args.docs, sharing=not args.no_sharing,
                        system_words=args.system_words, doc_words=args.doc_words,
                        question_words=args.question_words)
    out = {"bench": "routing", "backend": args.backend, "engines": args.engines, "sharing": not args.no_sharing,
           "report_s": args.report_s, "duration_s": args.duration_s}
    if args.backend == "llamacpp":
        if not args.rates:
            raise SystemExit("--backend llamacpp needs --rates (a saturation search in real time takes too long)")
        out.update(model=args.model, slots=args.slots, threads=args.threads, costs=costs,
                   results=llamacpp_results(args, workload, policies))
        print(json.dumps(out, indent=2))
        return
    out.update(profile=profile.__dict__, costs=costs)
    if args.rates:
        rates = [(float(r), None) for r in args.rates.split(",")]
    else:
        found = [find_saturation(args, workload, profile, p) for p in args.saturation_policies.split(",")]
        best = max(found, key=lambda f: f["rate_conversations_per_s"])
        out["saturation"] = {"rate_conversations_per_s": best["rate_conversations_per_s"],
                             "throughput_req_s": best["throughput_req_s"], "policy": best["policy"],
                             "per_policy": found}
        rates = [(best["rate_conversations_per_s"] * float(f), float(f)) for f in args.loads.split(",")]
    results = []
    for rate, load in rates:
        for policy in policies:
            r = run_sim(args, workload, policy, rate, profile)
            if load is not None:
                r["load_of_saturation"] = load
            note(f"{rate:>6.2f} conv/s {policy:<14} ttft p50 {r['ttft_ms_p50']} ms p99 {r['ttft_ms_p99']} ms "
                 f"hit {r['kv_hit_rate']} {r['throughput_req_s']}/{r['offered_req_s']} req/s")
            results.append(r)
    out["results"] = results
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

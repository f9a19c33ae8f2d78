"""``llmesh bench routing --json``: routing policies compared on one fleet of sim
engines under the same arrivals.

In one process: N real sim engine backends (the engine's own timing model, batching
and KV block ledger, prefix cache with LRU eviction) and the gateway's real picker.
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

from llmesh.gateway.picking import Endpoint, EndpointPicker, PickInput
from llmesh.kvhash import LLMESH_SCHEME, chain_hashes
from llmesh.prompt_tokens import sim_tokenize
from llmesh.types import Message, Prompt
from llmesh.engine.backends.base import DecodeParams
from llmesh.engine.backends.sim import SimBackend, SimProfile
from bench.common import note, pct

MODEL = "sim-bench"
POLICIES = ("round_robin", "least_loaded", "sglang_approx", "prefix_aware", "prefix_oracle")
CHUNK = 64  # characters per node of the approximate router's per-worker prefix index


def words(rng: random.Random, tag: str, n: int) -> str:
    return " ".join(f"{tag}{rng.randrange(5000)}" for _ in range(n))


class Workload:
    """Conversation scripts, fixed by the seed so every policy sees the same ones."""

    def __init__(self, seed: int, tenants: int, docs: int, sharing: bool):
        rng = random.Random(seed)
        self.systems = [words(rng, f"t{t}s", 300) for t in range(tenants)]
        self.docs = [words(rng, f"d{d}w", 900) for d in range(docs)]
        self.sharing = sharing
        self.seed = seed

    def conversation(self, n: int) -> list[list[Message]]:
        """The user turns of conversation ``n``: (system, first user message), then follow-ups."""
        rng = random.Random(self.seed * 1_000_003 + n)
        if not self.sharing:
            return [[Message("system", words(rng, f"u{n}x", 300)), Message("user", words(rng, "q", 30))]]
        if rng.random() < 0.3:  # document Q&A: one question over a shared document
            doc = rng.choice(self.docs)
            return [[Message("system", "answer from the document"), Message("user", doc + " question: "
                                                                             + words(rng, "q", 20))]]
        system = rng.choice(self.systems)
        turns = [[Message("system", system), Message("user", words(rng, "q", 30))]]
        turns += [[Message("user", words(rng, "f", 20))] for _ in range(rng.randrange(1, 4))]
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
    def __init__(self, n: int, profile: SimProfile, policy: str, report_s: float):
        self.engines = {f"engine-{i}": SimBackend(MODEL, 1 << 16, profile) for i in range(n)}
        self.inflight = Counter()
        self.served = Counter()
        self.picker = EndpointPicker(random.Random(0))
        self.policy = policy
        self.report_s = report_s
        self.max_batch = profile.max_batch
        self.sglang = SglangApprox(list(self.engines)) if policy == "sglang_approx" else None
        self._report()

    def _report(self) -> None:
        """What the scheduler stream brings: every engine's load and its KV block changes."""
        self.picker.replace_all(Endpoint(eid, eid, frozenset({MODEL}), running=min(n, self.max_batch),
                                         waiting=max(n - self.max_batch, 0), max_running=self.max_batch,
                                         kv_hash=LLMESH_SCHEME)
                                for eid in self.engines for n in (self.inflight[eid],))
        for eid, backend in self.engines.items():
            for ev in backend.kv_blocks.take_events():
                if ev.kind == "cleared":
                    self.picker.kv.apply(eid, True, (), ())
                elif ev.kind == "stored":
                    self.picker.kv.apply(eid, False, ev.hashes, ())
                elif ev.kind == "removed":
                    self.picker.kv.apply(eid, False, (), ev.hashes)

    async def reporter(self) -> None:
        while True:
            await asyncio.sleep(self.report_s)
            self._report()

    async def serve(self, messages: list[Message], max_tokens: int) -> tuple[float, str]:
        prompt = Prompt(messages=tuple(messages))
        tokens = sim_tokenize(prompt)
        if self.policy == "prefix_oracle":
            self._report()  # the exact cache of every engine, right now
        routing = "prefix_aware" if self.policy == "prefix_oracle" else self.policy
        pick = PickInput(MODEL, time.monotonic(), work_tokens=len(tokens) + max_tokens,
                         tokens=lambda: tokens)
        if self.sglang is not None:
            text = "".join(f"{m.role}: {m.content}\n" for m in messages)
            eid = self.sglang.choose(text, {e: self.inflight[e] for e in self.engines})
        else:
            eid = self.picker.pick(pick, routing).endpoint_id
        self.inflight[eid] += 1
        self.picker.acquire(eid, pick.work_tokens)
        started, ttft, parts = time.perf_counter(), None, []
        try:
            async for piece in self.engines[eid].stream(tokens, DecodeParams(max_tokens, 0.0, 1.0, 0)):
                if ttft is None:
                    ttft = time.perf_counter() - started
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

    async def close(self) -> None:
        for backend in self.engines.values():
            await backend.close()


async def run_one(args, workload: Workload, policy: str, rate: float, profile: SimProfile) -> dict:
    fleet = Fleet(args.engines, profile, policy, args.report_s)
    reporter = asyncio.create_task(fleet.reporter())
    rng = random.Random(args.seed)
    ttfts: list[float] = []
    tokens = 0

    async def conversation(n: int) -> None:
        nonlocal tokens
        history: list[Message] = []
        think = random.Random(n)
        for turn in workload.conversation(n):
            history += turn
            ttft, answer = await fleet.serve(history, args.max_tokens)
            ttfts.append(ttft)
            tokens += len(answer.split())
            history.append(Message("assistant", answer))
            await asyncio.sleep(think.expovariate(1 / args.think_s))

    started = time.perf_counter()
    tasks, n, at = [], 0, 0.0
    while True:
        at += rng.expovariate(rate)
        if at > args.duration_s:
            break
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        tasks.append(asyncio.create_task(conversation(n)))
        n += 1
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    reporter.cancel()
    await fleet.close()
    served = [fleet.served[eid] for eid in fleet.engines]
    return {"policy": policy, "rate_conversations_per_s": rate, "requests": len(ttfts),
            "ttft_ms_p50": round(pct(ttfts, 50) * 1000, 1), "ttft_ms_p99": round(pct(ttfts, 99) * 1000, 1),
            "throughput_req_s": round(len(ttfts) / elapsed, 2), "output_tokens_s": round(tokens / elapsed, 1),
            "kv_hit_rate": round(fleet.hit_rate(), 3),
            "load_imbalance_max_over_mean": round(max(served) / (sum(served) / len(served)), 2)}


def picking_costs(engines: int, blocks: int = 100_000, prompt_tokens: int = 2048) -> dict:
    """What prefix-aware picking costs a gateway: memory for ``blocks`` cached blocks per
    engine, and per request the block hashes of a prompt and the prefix scoring."""
    import tracemalloc
    from llmesh.gateway.picking.kvview import KvView
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--rates", default="2,4,6,8", help="conversations started per second, comma-separated")
    ap.add_argument("--duration-s", type=float, default=20.0, help="arrivals for this long, per run")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--profile", type=Path, help="a sim profile from `llmesh bench engine --calibrate`")
    ap.add_argument("--report-s", type=float, default=0.5, help="engine report interval (the picker's lag)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-sharing", action="store_true", help="every prompt its own (the no-sharing control)")
    ap.add_argument("--json", action="store_true", help="JSON only (the default prints JSON too)")
    ap.add_argument("--costs-only", action="store_true", help="only the per-request and memory costs")
    args = ap.parse_args()
    profile = (SimProfile.load(args.profile) if args.profile else
               SimProfile(prefill_ms_per_token=1.0, decode_ms_base=10.0, decode_ms_per_seq=0.5, kv_blocks=1024,
                          max_batch=16, output_tokens=args.max_tokens))
    costs = picking_costs(args.engines)
    if args.costs_only:
        print(json.dumps({"bench": "routing", "costs": costs}, indent=2))
        return
    workload = Workload(args.seed, tenants=6, docs=4, sharing=not args.no_sharing)
    results = []
    for rate in (float(r) for r in args.rates.split(",")):
        for policy in args.policies.split(","):
            if policy not in POLICIES:
                raise SystemExit(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
            r = asyncio.run(run_one(args, workload, policy, rate, profile))
            note(f"{rate:>5} conv/s {policy:<14} ttft p50 {r['ttft_ms_p50']} ms p99 {r['ttft_ms_p99']} ms "
                 f"hit {r['kv_hit_rate']}")
            results.append(r)
    print(json.dumps({"bench": "routing", "engines": args.engines, "sharing": not args.no_sharing,
                      "report_s": args.report_s, "profile": profile.__dict__, "costs": costs, "results": results}, indent=2))


if __name__ == "__main__":
    main()

"""Scorers: each rates every candidate in [0, 1], higher is better; the picker adds
them up by the policy's weights. Stateful ones (round robin) keep only their own state."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from hashlib import blake2b
from typing import Literal, get_args

from llmesh.gateway.upstream.picking.kvview import KvView
from llmesh.gateway.upstream.picking.load import held_blocks
from llmesh.gateway.upstream.picking.types import DEFAULT_OUTPUT_TOKENS, Endpoint, LocalState, PickInput


def _spread(values: Sequence[float]) -> list[float]:
    """Lower is better -> [0, 1]: the lowest gets 1, the highest 0, all equal all 1."""
    lo, hi = min(values), max(values)
    return [1.0] * len(values) if hi == lo else [(hi - v) / (hi - lo) for v in values]


class LeastLoad:
    """Fewest running + waiting requests per slot. ``1 / (1 + load)`` rather than a
    spread, so its weight against other scorers means the same at any fleet size."""
    name = "least_load"

    def scores(self, cands: list[Endpoint], req: PickInput, local: LocalState) -> list[float]:
        return [1.0 / (1.0 + local.load(e)) for e in cands]


class TokenAware:
    """Least estimated work queued (prefill + decode tokens). Our own in-flight tokens
    are exact; requests other gateways sent are counted at this request's size."""
    name = "token_aware"

    def scores(self, cands: list[Endpoint], req: PickInput, local: LocalState) -> list[float]:
        work = []
        for e in cands:
            others = max(local.requests(e) - local.inflight.get(e.endpoint_id, 0), 0)
            work.append(local.inflight_tokens.get(e.endpoint_id, 0) + others * max(req.work_tokens, 1))
        return _spread(work)


class PrefixAware:
    """Precise prefix affinity: the share of the request's tokens, from the start, that
    each engine holds in its KV cache, as its KV events (via the scheduler) say; the
    tokens are hashed with each engine's own scheme (an engine of unknown scheme: 0).
    A share counts in full where the cached part is at least the answer the request asks for
    (``max_tokens``, else ``DEFAULT_OUTPUT_TOKENS``), in proportion below: a decode-heavy request
    saves little prefill there, yet holds its slot for long, and a cached instruction of ~110
    tokens (55 % of its prompt) drew such requests to busier engines (bench.routing's pooled
    reasoning runs at saturation: prefix_aware's TTFT p99 1.14x least_loaded's; see ``TokenLoad``)."""
    name = "prefix_aware"

    def __init__(self, kv: KvView):
        self._kv = kv

    def scores(self, cands: list[Endpoint], req: PickInput, local: LocalState) -> list[float]:
        n = len(req.prompt_tokens())
        if not n:
            return [0.0] * len(cands)
        out = []
        for e in cands:
            s = e.kv_hash
            held = 0 if s is None else held_blocks(self._kv, e, req) * s.block_size
            answer = req.max_tokens or DEFAULT_OUTPUT_TOKENS
            out.append(held / n * min(held / answer, 1.0))
        return out


def _point(key: str) -> int:
    return int.from_bytes(blake2b(key.encode(), digest_size=8).digest(), "big")


class SessionAffinity:
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): a
    session goes to the first endpoint clockwise from its point on the ring whose load
    is within ``c`` times the average, so it sticks unless its endpoint is overloaded,
    and endpoints joining or leaving move only their own sessions."""
    name = "session_affinity"

    def __init__(self, c: float = 1.25, replicas: int = 40):
        self._c = c
        self._replicas = replicas

    def scores(self, cands: list[Endpoint], req: PickInput, local: LocalState) -> list[float]:
        if req.session is None:
            return [0.0] * len(cands)
        ring = sorted((_point(f"{e.endpoint_id}#{i}"), n) for n, e in enumerate(cands) for i in range(self._replicas))
        loads = [local.requests(e) for e in cands]
        bound = math.ceil(self._c * (sum(loads) + 1) / len(cands))  # this request included
        start = bisect.bisect(ring, (_point(req.session), -1))
        out = [0.0] * len(cands)
        for k in range(len(ring)):
            n = ring[(start + k) % len(ring)][1]
            if loads[n] + 1 <= bound:
                out[n] = 1.0
                break
        return out


class RoundRobin:
    """Each candidate in turn, per model, in endpoint id order."""
    name = "round_robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def scores(self, cands: list[Endpoint], req: PickInput, local: LocalState) -> list[float]:
        order = sorted(range(len(cands)), key=lambda n: cands[n].endpoint_id)
        turn = self._next.get(req.model, 0)
        self._next[req.model] = turn + 1
        out = [0.0] * len(cands)
        out[order[turn % len(cands)]] = 1.0
        return out


class LoraAffinity:
    """For a request naming a LoRA adapter: 1 where requests for that adapter are in
    flight already, else 0 (requests naming a model: 0 everywhere). Every candidate has
    the adapter loaded (serves_model); what differs is whether it is active: vLLM
    batches at most ``max_loras`` adapters at once, so joining a running adapter takes
    no adapter slot and swaps nothing in. From the engines' reports (``in_flight``)."""
    name = "lora_affinity"

    def scores(self, cands: list[Endpoint], req: PickInput, local: LocalState) -> list[float]:
        return [1.0 if e.adapters.get(req.model, 0) > 0 else 0.0 for e in cands]


# The scorers' names, as a model policy's ``scorers`` (live config) names them.
ScorerName = Literal["least_load", "token_aware", "prefix_aware", "session_affinity", "round_robin", "lora_affinity",
                     "token_load", "kv_cost", "sticky_affinity"]
SCORERS: tuple[ScorerName, ...] = get_args(ScorerName)
# The scorers that read the prompt's tokens (the picker then also counts what the chosen engine lacks).
PROMPT_SCORERS: tuple[ScorerName, ...] = ("prefix_aware", "token_load", "kv_cost", "sticky_affinity")

# Routing policy name -> scorer weights; a model's ``scorers`` in live config replaces them.
PRESETS: dict[str, dict[ScorerName, float]] = {
    "least_loaded": {"least_load": 1.0},
    "random": {},
    "round_robin": {"round_robin": 1.0},
    "token_aware": {"token_aware": 1.0},
    # the prefix share, the prefill ahead of the first token (the load ledger: queued uncached tokens
    # plus what this request lacks there, and a wait for a slot) and requests per slot; bench.routing's
    # field workloads (issue 32, docs/benchmarks.md, 2026-12-06, 256-sequence engines): TTFT p99 0.39-0.97x
    # the re-implemented llm-d sticky-until-saturated's on shared prefix, code generation and agents,
    # 1.01-1.02x least_loaded's on reasoning (8 seeds pooled). The share weighs 2: at 1.5 token_load's spread
    # moved agent turns off the engine holding their history (p99 at 80 % 464 ms against 161)
    "prefix_aware": {"prefix_aware": 2.0, "token_load": 1.0, "least_load": 1.0},
    # until issue 32: a whole cached prompt worth going from idle to 3 queued requests per slot
    "prefix_aware_v1": {"prefix_aware": 0.75, "least_load": 1.0},
    "session_affinity": {"session_affinity": 1.0, "least_load": 0.1},
    # re-implementations of the field's routers from their published descriptions (picking.load)
    "llmd_sticky": {"sticky_affinity": 2.0, "token_load": 1.0},
    "dynamo_kv": {"kv_cost": 1.0},
}

"""Load-aware scorers fed by the picker's load ledger (``LocalState``: the uncached prompt
tokens this gateway sent and has not seen start, and the sequences decoding), plus two
re-implementations of the field's routers from their published descriptions:

- ``sticky_affinity`` + ``token_load``: llm-d's "sticky until saturated" (our
  re-implementation, not llm-d's code): an endpoint holding at least ``threshold`` of the
  prompt keeps the request until its estimated prefill queue exceeds the best endpoint's by
  ``penalty_tokens`` (a calibration: the engine's peak prefill tokens/s times a time bound);
  then, and among the endpoints it keeps, the least token load wins.
- ``kv_cost``: a Dynamo-style KV router cost (our re-implementation, not Dynamo's code):
  ``overlap_weight x`` the prefill blocks the request would add there (its uncached
  blocks plus those queued) ``+`` the blocks decoding sequences hold there, this request's
  included; the lowest cost wins."""

from __future__ import annotations

import math

from llmesh.gateway.upstream.picking.kvview import KvView
from llmesh.gateway.upstream.picking.types import Endpoint, LocalState, PickInput


def held_blocks(kv: KvView, e: Endpoint, req: PickInput) -> int:
    """The prompt's leading blocks ``e``'s engine holds (or is expected to), counted once a pick."""
    n = req.matched.get(e.endpoint_id)
    if n is None:
        s = e.kv_hash
        n = req.matched[e.endpoint_id] = 0 if s is None else kv.matched(e.endpoint_id, req.block_hashes(s), req.now)
    return n


def uncached(kv: KvView, e: Endpoint, req: PickInput) -> int:
    """The prompt tokens ``e``'s engine would have to prefill for ``req`` (unknown scheme: all)."""
    n = len(req.prompt_tokens())
    s = e.kv_hash
    if s is None or not n:
        return n
    return max(n - held_blocks(kv, e, req) * s.block_size, 0)


def _spread(values: list[float]) -> list[float]:
    lo, hi = min(values), max(values)
    return [1.0] * len(values) if hi == lo else [(hi - v) / (hi - lo) for v in values]


def _each(req: PickInput) -> int:
    """What one request the reports show waiting (not ours) is counted at: this one's prompt."""
    return len(req.prompt_tokens()) or max(req.work_tokens, 1)


def prefill_after(kv: KvView, e: Endpoint, req: PickInput, local: LocalState) -> int:
    """Tokens ``e`` would prefill before ``req``'s first token: what is queued there, then ``req``'s own."""
    return local.queued_prefill(e, _each(req)) + uncached(kv, e, req)


class TokenLoad:
    """Least estimated work ahead of the request's first token: the prefill queued there and the
    request's own (what the engine lacks of it), the decoding sequences at ``decode_tokens``
    prompt-token equivalents each, and, where the request would find every slot taken (requests
    there, ours from the ledger, others' from the report, over ``max_running``), ``slot_tokens``
    for each request ahead of it in the queue: a wait for a sequence to end outweighs any
    prefill saved (bench.routing's decode-heavy workload: TTFT p99 6x least_loaded's without it).
    ``decode_tokens`` 32 rather than 16 (issue 32): at 16, a cached prefix of ~110 tokens was worth
    seven more sequences on its engine, and at saturation those held the slots a queue waits for
    (bench.routing's pooled reasoning runs at 100 %: prefix_aware's TTFT p99 1.05x least_loaded's at 16,
    1.03x at 32; at 80 % 0.97x and 1.01x)."""
    name = "token_load"

    def __init__(self, kv: KvView, decode_tokens: int = 32, slot_tokens: int = 8192):
        self._kv = kv
        self._decode = decode_tokens
        self._slot = slot_tokens

    def scores(self, cands: list[Endpoint], req: PickInput, local: LocalState) -> list[float]:
        return _spread([float(prefill_after(self._kv, e, req, local) + self._decode * local.decoding(e)
                              + self._slot * max(local.requests(e) + 1 - e.max_running, 0)) for e in cands])


class StickyAffinity:
    """1 for the endpoints holding at least ``threshold`` of the prompt's tokens that are not
    saturated: an endpoint is saturated when the prefill it would run before this request's
    first token exceeds the least any candidate would by more than ``penalty_tokens``. 0 for
    the rest; all 0 when none qualifies (then the token load alone decides)."""
    name = "sticky_affinity"

    def __init__(self, kv: KvView, threshold: float = 0.8, penalty_tokens: int = 4096):
        self._kv = kv
        self.threshold = threshold
        self.penalty_tokens = penalty_tokens

    def scores(self, cands: list[Endpoint], req: PickInput, local: LocalState) -> list[float]:
        n = len(req.prompt_tokens())
        if not n:
            return [0.0] * len(cands)
        ahead = [prefill_after(self._kv, e, req, local) for e in cands]
        best = min(ahead)
        out = []
        for e, a in zip(cands, ahead):
            share = 1.0 - uncached(self._kv, e, req) / n
            out.append(1.0 if share >= self.threshold and a - best <= self.penalty_tokens else 0.0)
        return out


class KvCost:
    """Dynamo-style cost: ``overlap_weight`` x potential prefill blocks + potential decode
    blocks, scored lowest-best (see the module's note)."""
    name = "kv_cost"

    def __init__(self, kv: KvView, overlap_weight: float = 1.0, block_size: int = 16):
        self._kv = kv
        self.overlap_weight = overlap_weight
        self._block = block_size

    def scores(self, cands: list[Endpoint], req: PickInput, local: LocalState) -> list[float]:
        prompt = len(req.prompt_tokens()) or max(req.work_tokens, 1)
        costs = []
        for e in cands:
            size = e.kv_hash.block_size if e.kv_hash is not None else self._block
            prefill = math.ceil(prefill_after(self._kv, e, req, local) / size)
            held = local.all_of("decode_tokens", e.endpoint_id)
            others = max(e.running - local.all_of("decode_seqs", e.endpoint_id), 0)  # reported, not the ledgers'
            decode = math.ceil((held + others * prompt + prompt) / size)
            costs.append(self.overlap_weight * prefill + decode)
        return _spread(costs)

"""The picker: filters, then weighted scorers, then the best (ties at random)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmesh.gateway.upstream.picking.filters import FILTERS, OPTIONAL_FILTERS, PREFERENCES, PROMPT_FILTERS, Filter
from llmesh.gateway.upstream.picking.kvview import KvView
from llmesh.gateway.upstream.picking.load import KvCost, StickyAffinity, TokenLoad, uncached
from llmesh.gateway.upstream.picking.scorers import (PRESETS, PROMPT_SCORERS, LeastLoad, LoraAffinity, PrefixAware,
                                                     RoundRobin, ScorerName, SessionAffinity, TokenAware)
from llmesh.gateway.upstream.picking.types import Endpoint, LocalState, PickInput


@dataclass(slots=True)
class Sent:
    """One request in the load ledger: where it went, the prompt tokens that engine lacked
    (queued prefill until its first chunk) and the context it holds while it decodes."""
    endpoint_id: str
    uncached: int
    context: int
    started: bool = False
    low: bool = False  # a lowest-priority request (a batch line)


class EndpointPicker:
    """Holds the gateway's view of the engines (the scheduler's table, the KV blocks,
    our own in-flight work) and picks one for a request by a routing policy."""

    def __init__(self, rng: random.Random | None = None, down_for_s: float = 2.0,
                 filters: Sequence[Filter] = FILTERS, expect_for_s: float = 10.0,
                 sticky_penalty_tokens: int = 4096):
        self._endpoints: dict[str, Endpoint] = {}
        # endpoint id -> the table change at which it last became healthy (absent: gone or unhealthy)
        self._appeared: dict[str, int] = {}
        self._changes = 0
        self._seen_models: set[str] = set()
        self._contexts: dict[str, int] = {}
        self.kv = KvView()
        self.local = LocalState()
        self._down_for = down_for_s
        self._expect_for = expect_for_s
        self._rng = rng or random.Random()
        self._filters = filters
        self.on_table: list[Callable[[], None]] = []  # told after each new endpoint table
        self.on_ledger: list[Callable[[], None]] = []  # told after each change of the load ledger
        self._picked: tuple[str, PickInput] | None = None  # the last pick, until a request is acquired
        self._scorers = {s.name: s for s in (LeastLoad(), TokenAware(), PrefixAware(self.kv), SessionAffinity(),
                                             RoundRobin(), LoraAffinity(), TokenLoad(self.kv), KvCost(self.kv),
                                             StickyAffinity(self.kv, penalty_tokens=sticky_penalty_tokens))}

    def replace_all(self, endpoints: Iterable[Endpoint]) -> None:
        old, self._endpoints = self._endpoints, {e.endpoint_id: e for e in endpoints}
        self._changes += 1
        appeared: dict[str, int] = {}
        for eid, e in self._endpoints.items():
            before = old.get(eid)
            if before is None or (before.running, before.waiting) != (e.running, e.waiting):
                self.local.since_report.pop(eid, None)  # a fresh report already counts our work
            if e.healthy:  # healthy before too: it keeps its number
                appeared[eid] = self._appeared.get(eid, self._changes)
        self._appeared = appeared
        self.local.reported = {eid: (e.running, e.waiting) for eid, e in self._endpoints.items()}
        self.local.shared_names = {eid: f"{eid} {e.address}" for eid, e in self._endpoints.items()}
        contexts: dict[str, int] = {}
        for e in self._endpoints.values():
            self._seen_models |= e.models
            for model in e.models:  # 0: an endpoint did not say, so the model's context is unknown
                reported, known = e.context.get(model, 0), contexts.get(model, -1)
                contexts[model] = 0 if not reported or not known else max(known, reported)
        self._contexts = contexts
        self.kv.keep_only(set(self._endpoints))
        for listener in self.on_table:
            listener()

    def appeared(self, endpoint_id: str) -> int | None:
        """When the endpoint last came into the table healthy (a number that only grows: an
        engine that left, or turned unhealthy, and came back has a new one); None while it
        is gone or unhealthy."""
        return self._appeared.get(endpoint_id)

    def routable(self, endpoint_id: str, req: PickInput) -> Endpoint | None:
        """The endpoint, when every always-on filter keeps it for ``req``; else None."""
        self._picked = None
        e = self._endpoints.get(endpoint_id)
        return e if e is not None and all(f.keep(e, req, self.local) for f in self._filters) else None

    def context_length(self, model: str) -> int | None:
        """The largest context an endpoint serving ``model`` reported; None when none serves it
        or one of them did not say."""
        return self._contexts.get(model) or None

    def all(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def models(self) -> set[str]:
        """Models some endpoint serves now."""
        return {m for e in self._endpoints.values() for m in e.models}

    def healthy_models(self) -> set[str]:
        """Models some healthy endpoint serves now: what the model list may name (a degraded
        node's count too: it answers when no other endpoint can)."""
        return {m for e in self._endpoints.values() if e.healthy for m in e.models}

    def embedding_models(self) -> set[str]:
        """Models some endpoint serves as an embedding model (Embed, not Generate)."""
        return {m for e in self._endpoints.values() for m in e.embeds}

    def tool_models(self) -> set[str]:
        """Models some endpoint serves with a backend that calls tools."""
        return {m for e in self._endpoints.values() for m in e.tools}

    def generative_models(self) -> set[str]:
        """Models some endpoint serves for Generate."""
        return {m for e in self._endpoints.values() for m in e.models - e.embeds}

    def seen_models(self) -> set[str]:
        """Models any endpoint has served since start: asking for one whose engines are
        all gone is 'unavailable', not 'no such model'."""
        return self._seen_models

    def candidates(self, req: PickInput) -> list[Endpoint]:
        cands = [e for e in self._endpoints.values() if all(f.keep(e, req, self.local) for f in self._filters)]
        # not degraded, then the policy's optional filters: each narrows the set, never empties it
        for f in (*PREFERENCES, *(OPTIONAL_FILTERS[name] for name in req.filters)):
            kept = [e for e in cands if f.keep(e, req, self.local)]
            if kept:
                cands = kept
        return cands

    def pick(self, req: PickInput, routing: str = "least_loaded",
             weights: Mapping[ScorerName, float] | None = None) -> Endpoint | None:
        self._picked = None
        req.matched.clear()  # what the engines hold may have changed since an earlier pick for it
        cands = self.candidates(req)
        weights = weights or PRESETS[routing]
        if len(cands) <= 1:
            if cands and self._prompt_known(weights):
                req.uncached = uncached(self.kv, cands[0], req)
                self._picked = (cands[0].endpoint_id, req)
            return cands[0] if cands else None
        total = [0.0] * len(cands)
        for name, w in weights.items():
            if w:
                for n, s in enumerate(self._scorers[name].scores(cands, req, self.local)):
                    total[n] += w * s
        top = max(total)
        best = [e for e, t in zip(cands, total) if t >= top - 1e-9]
        chosen = best[0] if len(best) == 1 else self._rng.choice(best)
        req.uncached = uncached(self.kv, chosen, req) if self._prompt_known(weights) else None
        self._picked = (chosen.endpoint_id, req) if req.uncached is not None else None
        if chosen.kv_hash is not None and chosen.kv_hash in req.hashed():
            # Its engine will hold the prompt's blocks before its KV events can say so.
            self.kv.expect(chosen.endpoint_id, req.block_hashes(chosen.kv_hash), req.now + self._expect_for)
        return chosen

    def capacity(self, req: PickInput, engine_queue: int = 0) -> tuple[int, int, int]:
        """The request's eligible endpoints' slots (running slots, plus up to ``engine_queue`` of
        each one's own queue): (free now, in all, this gateway's requests in flight there)."""
        free = total = ours = 0
        for e in self.candidates(req):
            cap = e.max_running + min(engine_queue, e.max_waiting)
            total += cap
            free += max(0, cap - self.local.requests(e))
            ours += self.local.inflight.get(e.endpoint_id, 0)
        return free, total, ours

    @staticmethod
    def reads_prompt(routing: str, weights: Mapping[ScorerName, float] | None, filters: Sequence[str] = ()) -> bool:
        """Whether a pick under this policy reads the prompt's tokens (a scorer or the optional
        ``context_fits`` filter): only then is a long prompt worth tokenizing before it."""
        return EndpointPicker._prompt_known(weights or PRESETS[routing]) or any(f in PROMPT_FILTERS for f in filters)

    @staticmethod
    def _prompt_known(weights: Mapping[ScorerName, float]) -> bool:
        """Whether the policy reads the prompt's tokens (so the pick can count what is uncached
        at no extra cost); a policy that never tokenizes counts the request by its work estimate."""
        return any(weights.get(n) for n in PROMPT_SCORERS)

    def low_room(self, headroom: float, unbounded: int) -> int:
        """Lowest-priority requests (batch lines) this process may have in flight: the healthy
        generating engines' slots less ``headroom`` of them and less the other work there (every
        gateway's, as ``requests`` counts it, but this process's own low ones); ``unbounded``
        with no such engine (providers only)."""
        engines = [e for e in self._endpoints.values() if e.healthy and e.models - e.embeds]
        if not engines:
            return unbounded
        slots = sum(e.max_running for e in engines)
        others = max(0, sum(self.local.requests(e) for e in engines) - self.local.low_inflight)
        return slots - math.ceil(headroom * slots) - others

    def acquire(self, endpoint_id: str, tokens: int = 0, req: PickInput | None = None, low: bool = False) -> Sent:
        """Counts a request sent to ``endpoint_id``: the prompt tokens its engine lacks (as the
        pick for ``req`` counted them; without ``req``, the last pick's when it chose this
        endpoint and nothing was acquired since, as a caller that acquires right after picking
        gets; else ``tokens``) join the ledger's queued prefill until ``started``. ``low``: a
        lowest-priority request, counted in ``low_inflight`` too when it goes to an engine."""
        low = low and endpoint_id in self._endpoints  # a provider's call takes no engine slot
        if req is None and self._picked is not None and self._picked[0] == endpoint_id:
            req = self._picked[1]
        self._picked = None
        prompt = len(req.prompt_tokens()) if req is not None and req.uncached is not None else tokens
        ticket = Sent(endpoint_id, req.uncached if req is not None and req.uncached is not None else tokens, prompt,
                      low=low)
        loc = self.local
        loc.low_inflight += low
        loc.add("prefill_tokens", endpoint_id, ticket.uncached)
        loc.add("prefill_requests", endpoint_id, 1)
        loc.inflight[endpoint_id] = loc.inflight.get(endpoint_id, 0) + 1
        loc.inflight_tokens[endpoint_id] = loc.inflight_tokens.get(endpoint_id, 0) + tokens
        loc.since_report[endpoint_id] = loc.since_report.get(endpoint_id, 0) + 1
        self._ledger_changed()
        return ticket

    def started(self, ticket: Sent) -> None:
        """Its first chunk came: its prefill is done, it decodes, holding its context."""
        if ticket.started:
            return
        ticket.started = True
        loc, eid = self.local, ticket.endpoint_id
        loc.add("prefill_tokens", eid, -ticket.uncached)
        loc.add("prefill_requests", eid, -1)
        loc.add("decode_seqs", eid, 1)
        loc.add("decode_tokens", eid, ticket.context)
        self._ledger_changed()

    def release(self, endpoint_id: str, tokens: int = 0, ticket: Sent | None = None) -> None:
        loc = self.local
        ticket = ticket or Sent(endpoint_id, tokens, tokens)  # what ``acquire`` booked without a request
        self.started(ticket)  # a request that ended before its first chunk leaves the queue too
        loc.add("decode_seqs", endpoint_id, -1)
        loc.add("decode_tokens", endpoint_id, -ticket.context)
        loc.since_report[endpoint_id] = loc.since_report.get(endpoint_id, 0) - 1
        loc.low_inflight -= ticket.low
        for counts, n in ((loc.inflight, 1), (loc.inflight_tokens, tokens)):
            left = counts.get(endpoint_id, 0) - n
            if left > 0:
                counts[endpoint_id] = left
            else:
                counts.pop(endpoint_id, None)
        self._ledger_changed()

    def _ledger_changed(self) -> None:
        for listener in self.on_ledger:
            listener()

    def mark_down(self, endpoint_id: str, now: float) -> None:
        """Skip an endpoint that refused a connection until the scheduler catches up."""
        self.local.down_until[endpoint_id] = now + self._down_for

"""The response cache's domain: what is cacheable (live config), exact then semantic
lookup, store, invalidation and stats over a fail-open store. No gRPC here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np

from llmesh.background import Background
from llmesh.errors import InvalidArgument
from llmesh.liveconfig.schema import CacheConfig, CachePolicy, CacheVerifier
from llmesh.cache.failopen import FailOpen
from llmesh.cache.keys import Request, embedded_scope, exact_key, semantic_query
from llmesh.cache.semantic import Embedder, SemanticIndex
from llmesh.cache.store import Entry, Name, Selector, Stored, TenantStats

log = logging.getLogger("llmesh.cache")


@dataclass(frozen=True, slots=True)
class Hit:
    response: bytes
    kind: Literal["exact", "semantic"]
    key: str
    similarity: float = 1.0
    loosened: bool = False  # a semantic hit only the caller's looser threshold allowed


# The verifier's port: (its config, the stored question, the asked one) -> may the stored answer serve?
Judge = Callable[[CacheVerifier, str, str], Awaitable[bool]]

Found = Literal["hit_exact", "hit_semantic", "miss"]
Outcome = Literal[Found, "uncacheable", "bypass"]
# A lookup whose caller gave up: what it found, or "dropped" (LATE_MAX late ones were running: it was
# cancelled, and its embedding, if still queued for a worker thread, never runs).
Late = Literal[Found, "dropped"]
# Late lookups finishing at once: past it an overloaded cache sheds them, as it did before they finished
# (a cancelled embedding still queued for a thread is dropped), instead of piling up work nobody awaits.
LATE_MAX = 8


def _outcome(hit: Hit | None) -> Found:
    return "miss" if hit is None else "hit_exact" if hit.kind == "exact" else "hit_semantic"


# The loosest semantic threshold a caller may ask for (degradation under load): below it MiniLM's
# cosine says little about whether two questions share an answer, guards or not.
LOOSEST = 0.5


class ResponseCache:
    def __init__(self, store: FailOpen, semantic: SemanticIndex | None, config: Callable[[], CacheConfig],
                 on_lookup: Callable[[Outcome], None] = lambda outcome: None,
                 on_late: Callable[[Late], None] = lambda outcome: None,
                 embedder: Callable[[CacheConfig], Embedder | None] | None = None,
                 on_embed_error: Callable[[str], None] = lambda error: None, judge: Judge | None = None,
                 on_verdict: Callable[[str, str], None] = lambda stage, verdict: None):
        """``embedder``: the one the live config chooses now (None: none ready, semantic matching
        waits); by default the semantic index's own."""
        self._store = store
        self._semantic = semantic
        self._config = config
        self._embedder_for = embedder or (lambda cfg: semantic.embedder if semantic is not None else None)
        self._on_embed_error = on_embed_error
        self._judge = judge  # the verifier's port: None, no verifier whatever the config says
        self._on_verdict = on_verdict  # (stage, verdict): guards passed; judge yes, no, timeout, error
        self._on_lookup = on_lookup
        self._on_late = on_late  # a lookup whose caller had given up, by what it found
        self._background = Background()
        self._late = 0  # late lookups running

    @property
    def semantic_indexed(self) -> int:
        return len(self._semantic) if self._semantic is not None else 0

    def _policy(self, req: Request) -> CachePolicy | None:
        policy = self._config().policy(req.tenant, req.model)
        cacheable = (policy.enabled and (req.sampling.deterministic or policy.cache_sampled)
                     and req.sampling.logprobs is None)  # the cache keeps text only
        return policy if cacheable else None

    async def lookup(self, req: Request, min_similarity: float | None = None) -> Hit | None:
        """``min_similarity``: a looser semantic threshold the gateway asks for under load (never
        below ``LOOSEST``; ignored where it is not lower than the policy's own)."""
        policy = self._policy(req)
        if policy is None:
            self._on_lookup("uncacheable")
            return None
        if not self._store.available:
            self._on_lookup("bypass")
            return None
        # A caller that gives up (the gateway's budget) cancels this call, not the lookup: it runs to its
        # end (its embedding runs on a worker thread either way, and the store after the miss takes it
        # from the memo) and is counted as late, by what it found: a late hit is an answer the budget lost.
        work = asyncio.ensure_future(self._lookup(req, policy, min_similarity))
        try:
            hit = await asyncio.shield(work)
        except asyncio.CancelledError:
            if self._late < LATE_MAX:
                self._late += 1
                self._background.spawn(self._finish_late(req, work))
            else:
                work.cancel()
                self._on_late("dropped")
            raise
        self._on_lookup(_outcome(hit))
        self._count(req.tenant, ["misses"] if hit is None else ["hits", "semantic_hits"] if hit.kind == "semantic"
                    else ["hits"])
        return hit

    async def _finish_late(self, req: Request, work: asyncio.Future[Hit | None]) -> None:
        try:
            hit = await work
        except Exception:  # nobody waits for it any more: logged, not raised
            log.exception("a late cache lookup failed")
            return
        finally:
            self._late -= 1
        self._on_late(_outcome(hit))
        self._count(req.tenant, ["misses"])  # the tenant's caller got none

    def _count(self, tenant: str, counters: list[str]) -> None:
        for counter in counters:
            self._background.spawn(
                self._store.call("count", partial(self._store.store.count, tenant, counter), None))

    async def _lookup(self, req: Request, policy: CachePolicy, loose: float | None) -> Hit | None:
        key = exact_key(req)
        name = Name(req.tenant, req.model, "x", key)
        entry = await self._store.call("get", lambda: self._store.store.get(name), None)
        if entry is not None:
            return Hit(entry.response, "exact", key)
        if policy.mode != "semantic" or self._semantic is None or not self._store.available:
            return None
        return await self._nearest(req, policy, loose)

    async def _nearest(self, req: Request, policy: CachePolicy, loose: float | None) -> Hit | None:
        """The semantic match: nearest entries of the scope above the threshold that pass the
        guards, and, with a verifier on, the judge's yes (candidates from its own threshold);
        ``loose`` lowers that threshold (a hit below the usual one is marked ``loosened``)."""
        assert self._semantic is not None
        config = self._config()
        query = semantic_query(req)
        embedder = self._embedder_for(config) if query is not None else None
        if query is None or embedder is None:
            return None
        vector = await self._embed(embedder, query.text)
        if vector is None:
            return None
        verifier = config.verifier if config.verifier.enabled and self._judge is not None else None
        usual = verifier.candidate_threshold if verifier is not None else policy.semantic_threshold
        threshold = usual if loose is None else min(usual, max(loose, LOOSEST))
        scope, judged = embedded_scope(embedder.identity, query.scope), 0
        for candidate in self._semantic.search(scope, query.text, vector, threshold):
            self._on_verdict("guards", "passed")
            entry = await self._store.call("get", partial(self._store.store.get, candidate.name), None)
            if entry is None:
                if self._store.available:  # gone from the store (expired, evicted, invalidated elsewhere)
                    self._semantic.remove(candidate.name)
                continue
            if verifier is not None:
                if judged == verifier.max_candidates:
                    break
                judged += 1
                if not await self._verdict(verifier, entry.text, query.text):
                    continue
            return Hit(entry.response, "semantic", candidate.name.digest, candidate.similarity,
                       loosened=candidate.similarity < usual)
        return None

    async def _verdict(self, verifier: CacheVerifier, stored: str, asked: str) -> bool:
        """The judge's yes within its time budget; a no, a timeout or an error is a no (counted)."""
        assert self._judge is not None
        try:
            same = await asyncio.wait_for(self._judge(verifier, stored, asked), verifier.timeout_s)
        except TimeoutError:
            self._on_verdict("judge", "timeout")
            return False
        except Exception as exc:  # noqa: BLE001 - a judge away or answering badly: no hit, never a failure
            log.warning("cache verifier failed", extra={"error": type(exc).__name__})
            self._on_verdict("judge", "error")
            return False
        self._on_verdict("judge", "yes" if same else "no")
        return same

    async def _embed(self, embedder: Embedder, text: str) -> np.ndarray | None:
        """The embedding, computed on a worker thread (the loop keeps answering exact
        lookups); the memo is only touched here, on the loop. None: the embedder failed
        (an endpoint away or slow), and the request is matched exactly only."""
        semantic = self._semantic
        assert semantic is not None  # callers embed for the semantic index only
        key = (embedder.identity, text)
        vector = semantic.remembered(key)
        if vector is None:
            try:
                vector = await asyncio.to_thread(embedder.encode, text)
            except Exception as exc:  # noqa: BLE001 - the cache never fails a request: no semantic match
                self._on_embed_error(type(exc).__name__)
                log.warning("embedding failed", extra={"identity": embedder.identity, "error": type(exc).__name__})
                return None
            semantic.remember(key, vector)
        return vector

    async def store(self, req: Request, response: bytes) -> bool:
        policy = self._policy(req)
        if policy is None or not self._store.available:
            return False
        name = Name(req.tenant, req.model, "x", exact_key(req))
        evicted = await self._store.call("put", lambda: self._store.store.put(name, Entry(response), policy.ttl_s),
                                         None)
        if evicted is None:
            return False
        semantic = self._semantic if policy.mode == "semantic" else None
        query = semantic_query(req) if semantic is not None else None
        embedder = self._embedder_for(self._config()) if query is not None else None
        vector = None
        if semantic is not None and query is not None and embedder is not None:
            vector = await self._embed(embedder, query.text)
        if semantic is not None and query is not None and embedder is not None and vector is not None:
            scope = embedded_scope(embedder.identity, query.scope)
            sname = Name(req.tenant, req.model, "s", name.digest)  # one digest: invalidated together
            entry = Entry(response, vector.tobytes(), query.text, scope)
            more = await self._store.call("put", lambda: self._store.store.put(sname, entry, policy.ttl_s), None)
            if more is not None:
                semantic.add(sname, scope, query.text, vector, policy.ttl_s)
                evicted += more
        for gone in evicted:
            if self._semantic is not None:
                self._semantic.remove(gone)
        return True

    async def invalidate(self, selector: Selector, everything: bool = False) -> int:
        if selector.tenant is None and selector.model is None and not selector.prefix and not everything:
            raise InvalidArgument("Name a tenant, a model or a key prefix to invalidate, or ask for all.",
                                  param="tenant")
        if selector.prefix and any(c not in "0123456789abcdef" for c in selector.prefix):
            raise InvalidArgument("A key prefix is lower-case hex (the start of a key digest).", param="key_prefix")
        removed = await self._store.store.invalidate(selector)  # an admin call: errors surface, no bypass
        if self._semantic is not None:
            self._semantic.remove_matching(selector)
        log.info("cache invalidated", extra={"tenant": selector.tenant, "model": selector.model,
                                             "prefix": selector.prefix, "removed": len(removed)})
        return len(removed)

    async def stats(self, tenant: str | None = None) -> dict[str, TenantStats]:
        return await self._store.store.stats(tenant)

    async def rebuild(self) -> int:
        """Index every semantic entry the store holds (at start: a restart loses nothing)."""
        if self._semantic is None:
            return 0
        n, batch = 0, []
        async for stored in self._store.store.semantic_entries():
            e = stored.entry
            batch.append((stored.name, e.scope, e.text, np.frombuffer(e.vector, dtype=np.float32), stored.ttl_left_s))
            if len(batch) >= 1000:
                n += len(batch)
                self._semantic.add_many(batch)
                batch = []
        self._semantic.add_many(batch)
        return n + len(batch)

    async def follow(self, on_rebuilt: Callable[[int], None] = lambda n: None) -> None:
        """Keep the index current with what every replica stores: listen, read what the
        store already holds, then add each new entry as it is announced. Returns when
        the store has nothing more to announce; raises if the store goes away."""
        if self._semantic is None:
            return
        async for stored in self._store.store.watch_semantic():
            if stored is None:
                on_rebuilt(await self.rebuild())
            elif stored.name not in self._semantic:
                self._index(stored)

    def _index(self, stored: Stored) -> None:
        e = stored.entry
        assert self._semantic is not None  # follow() indexes only with a semantic index
        self._semantic.add(stored.name, e.scope, e.text, np.frombuffer(e.vector, dtype=np.float32), stored.ttl_left_s)

    async def drain(self) -> None:
        await self._background.drain()

"""Flow control's fair order and queue depth for one model, shared by every gateway worker
and replica through Redis (the semantics are FairQueue's, services/gateway/domain/fairness.py).

Only what decides the order and the capacity is shared; the waiting requests themselves stay
in the worker that holds them. Per model (one hash slot: ``llmesh:fq:{model}:``):

- each class's virtual time and per-tenant finish tags, and a sorted set of its queued
  entries keyed by start tag (ties: the entry id, a zero-padded arrival number);
- an entry hash per entry (tenant, class, cost, weight, quiet, owner, ``status``);
- per-tenant queued counts (in all and per class), the model's queued count, per class the
  count of entries released and not yet done and the cost queued;
- the cost of the requests served, in one-second buckets over the last 30 s, the model's and
  each tenant's, and each tenant's cost queued per class (what a new entry's wait is estimated
  from: the queue ahead of it over the model's throughput, and at least its tenant's own queue
  ahead of it over what that tenant is being served at).

Each step is one Lua script call (fairness_scripts.py), atomic across workers. ``release`` hands out the global
head(s) whoever holds them: free slots are this worker's view capped by the slots in all
less every worker's released-and-not-done entries, so two workers never release into the
same slot. The worker holding an entry learns it was released or refused from its
``status``; a PUBLISH on the model's channel wakes the others (their tick polls as a
backstop). Each worker keeps a heartbeat in the model's ``alive`` set: a worker whose
heartbeat lapsed has its queued entries dropped and its released ones' slots freed by
whichever worker calls next. Pure of the transport: it takes a ``redis.asyncio`` client. A call
whose task is being cancelled raises CancelledError once Redis has answered, even where redis-py
swallowed the cancellation (llmesh.background.honour_cancel): the loops over it stop."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from llmesh.background import honour_cancel
from llmesh.gateway.domain.fairness import CLASSES, Entry, Rules
from llmesh.gateway.domain.fairness_scripts import BEAT, ENTER, LEAVE, PROMOTE, RELEASE


class RedisClient(Protocol):
    """What this module uses of a ``redis.asyncio`` client."""

    def register_script(self, script: str) -> Any: ...

    def pipeline(self, transaction: bool = True) -> Any: ...

    def hget(self, name: str, key: str) -> Any: ...

    def smembers(self, name: str) -> Any: ...


def prefix(model: str) -> str:
    return f"llmesh:fq:{{{model}}}:"


@dataclass(frozen=True, slots=True)
class Entered:
    """``status``: ``queued``, or why it was refused (``queue_full``, ``tenant_queue_full``);
    ``victim``: the id of a queued entry (any worker's) it displaced, or ''; ``wait_s``: its wait
    by the estimate (the cost queued ahead of it over the model's throughput, measured from the
    requests every worker served in the last 30 s, and at least its tenant's own cost queued ahead
    of it over what that tenant was served; refused: the wait at the back of its class), None until
    the model's throughput is known."""
    eid: str
    status: str
    victim: str
    wait_s: float | None = None


T = TypeVar("T")


async def _call(aw: Awaitable[T]) -> T:
    res = await aw
    honour_cancel()
    return res


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class SharedQueue:
    """One model's shared fair order, as seen by one worker (``worker``: unique per process).
    ``now_ms`` is wall-clock milliseconds: every worker's clock must agree to within the
    heartbeat's ``ttl_ms``."""

    def __init__(self, client: RedisClient, model: str, worker: str, ttl_ms: int = 5000):
        self._redis = client
        self._p = prefix(model)
        self.worker = worker
        self._ttl = ttl_ms
        self._enter = client.register_script(ENTER)
        self._release = client.register_script(RELEASE)
        self._leave = client.register_script(LEAVE)
        self._beat = client.register_script(BEAT)
        self._promote = client.register_script(PROMOTE)

    @property
    def channel(self) -> str:
        """Published to when entries leave the queue or free a slot."""
        return self._p + "wake"

    async def enter(self, e: Entry, rules: Rules, now_ms: int, free: int = 0, total: int = 0) -> Entered:
        """Tags ``e`` against the shared virtual time and queues it, within the bounds; ``free``
        (this worker's view) and ``total``: the slots, of which those free now (capped as
        ``release`` caps them) leave the queue at the next release, so they wait past no bound."""
        res = await _call(self._enter(keys=[self._p], args=[
            now_ms, self.worker, self._ttl, e.tenant, e.klass, e.cost, e.weight, rules.burst_tokens,
            rules.max_queued_per_tenant, rules.max_queued, free, total]))
        wait = float(_s(res[3])) if len(res) > 3 else -1.0
        return Entered(_s(res[0]), _s(res[1]), _s(res[2]), wait if wait >= 0 else None)

    async def release(self, free: int, total: int, rules: Rules, now_ms: int) -> list[str]:
        """Releases the global head(s) for up to ``free`` slots (capped by ``total`` less every
        worker's released entries); returns their ids, whichever worker holds them."""
        res = await _call(self._release(keys=[self._p], args=[
            now_ms, self.worker, self._ttl, free, total, rules.quiet_share,
            *(rules.rule(k).reserved_share for k in range(len(CLASSES)))]))
        return [_s(x) for x in res]

    async def leave(self, eid: str, why: str = "withdrawn", now_ms: int = 0, served: bool = False,
                    only_queued: bool = False) -> str:
        """The entry goes: a queued one leaves the order (it charges its tenant nothing when it
        was the last tagged), a released one frees its slot (``served``: its cost counts in the
        throughput at ``now_ms``). ``only_queued``: it goes only if it is still queued (a refusal
        that must not take a slot it was just given). Returns the status it had (``queued``,
        ``released``, a refusal's reason, or '' when it was already gone)."""
        return _s(await _call(self._leave(keys=[self._p], args=[
            eid, why, now_ms, "1" if served else "0", "1" if only_queued else "0"])))

    async def promote(self, rules: Rules, now_ms: int) -> list[str]:
        """Moves each entry queued in its class past the class's ``promote_after_s`` up one class,
        at the front of that class's fair order; returns their ids."""
        limits = [rules.rule(k).promote_after_s for k in range(len(CLASSES) - 1)]
        res = await _call(self._promote(keys=[self._p], args=[
            now_ms, self.worker, self._ttl, *(-1 if x is None else int(x * 1000) for x in limits)]))
        return [_s(x) for x in res]

    async def heartbeat(self, now_ms: int) -> None:
        """Keeps this worker's entries alive, and drops those of workers whose heartbeat lapsed."""
        await _call(self._beat(keys=[self._p], args=[now_ms, self.worker, self._ttl]))

    async def refusal_wait(self, eid: str) -> float | None:
        """The wait the estimate gave an entry preempted or shed by another's arrival (its
        Retry-After), None when unknown."""
        wait = await _call(self._redis.hget(self._p + "e:" + eid, "wait"))
        return None if wait is None or float(wait) < 0 else float(wait)

    async def statuses(self, eids: list[str]) -> dict[str, str]:
        """Each entry's status ('' when it is gone)."""
        pipe = self._redis.pipeline(transaction=False)
        for eid in eids:
            pipe.hget(self._p + "e:" + eid, "status")
        res = await _call(pipe.execute())
        return {eid: "" if s is None else _s(s) for eid, s in zip(eids, res)}

    async def owned(self) -> set[str]:
        """The ids of the entries Redis holds for this worker (queued or released)."""
        return {_s(x) for x in await _call(self._redis.smembers(self._p + "w:" + self.worker))}

    async def counts(self) -> tuple[int, int]:
        """The model's queued entries and its released-and-not-done ones, over every worker."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.get(self._p + "n")
        pipe.hvals(self._p + "inf")
        n, inf = await _call(pipe.execute())
        return int(n or 0), sum(int(x) for x in inf)

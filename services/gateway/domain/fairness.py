"""Flow control's queues for one model: token-weighted fair order across tenants, in
priority classes, bounded, with deadlines. Pure: no clock, no I/O, no asyncio (the
flow stage drives it and turns its verdicts into answers).

- **Fair order** is start-time fair queueing (SFQ) over tokens: a request's cost is its
  expected tokens (input plus expected output), divided by its tenant's weight. On arrival
  it is tagged ``start = max(V, tenant's last finish)``, ``finish = start + cost / weight``;
  the queued request with the smallest start goes first, and ``V`` (the class's virtual
  time) becomes its start. A tenant that sends ten times more only queues ten times deeper:
  under contention each tenant's served tokens follow its weight. An idle tenant earns no
  more credit than ``burst_tokens`` (its next start is at least ``V - burst_tokens / weight``):
  a quiet tenant's short burst goes ahead of a backlogged one, and no tenant's lead grows
  past that bound, so long-run shares still follow the weights.
- **Classes** (``batch`` < ``standard`` < ``critical``) each have their own fair queue; a
  higher class goes first, except that a class's reserved share of the model's slots, while
  that class does not use it, is held back from the others.
- **Quiet tenants**: a share of the slots (``quiet_share``) is left to requests whose tenant
  had nothing queued in their class when they came, so a light tenant's request finds a slot
  at once instead of waiting for the next one to free behind a flood.
- **Bounds**: per tenant and overall. A full queue sheds the newest queued request of a lower
  class than the newcomer's (``preempted``), else, overall, of the tenant with the longest
  queue in the newcomer's class (``shed``), else refuses the newcomer. Only queued requests
  are ever shed: a released one has its slot until it ends.
- **Promotion**: a request queued in its class longer than the class's ``promote_after_s``
  moves up one class (at the front of that class's fair order).
- **Deadlines**: a request that would wait past its deadline by the estimate (the tokens
  queued ahead of it over the model's measured throughput) is refused at once with that
  estimate; one still queued at its deadline leaves (``expire``)."""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import cast

from llmesh.types import Priority

CLASSES = ("batch", "standard", "critical")  # lowest first; an entry's ``klass`` is an index here
CLASS_OF = {Priority.LOW: 0, Priority.NORMAL: 1, Priority.HIGH: 2}  # a request's priority -> its class
TAGS_KEPT = 1024  # past this many tenants' finish tags, those no longer ahead of V are dropped


@dataclass(frozen=True, slots=True)
class ClassRule:
    reserved_share: float = 0.0  # of the model's slots, held for this class while it does not use them
    promote_after_s: float | None = None  # queued longer than this: up one class; None: never


@dataclass(frozen=True, slots=True)
class Rules:
    max_queued_per_tenant: int = 256
    max_queued: int = 4096
    classes: Mapping[str, ClassRule] = field(default_factory=dict)  # by class name; absent: ClassRule()
    burst_tokens: float = 0.0  # how far behind V a tenant's next start may be: a quiet tenant's burst goes first
    quiet_share: float = 0.0  # of the model's slots, only for a request whose tenant had nothing queued

    def rule(self, klass: int) -> ClassRule:
        return self.classes.get(CLASSES[klass]) or ClassRule()


@dataclass(eq=False, slots=True)
class Entry:
    """One request waiting for (or holding) a slot."""
    tenant: str
    klass: int
    cost: float  # expected tokens: input plus expected output
    arrived: float
    deadline: float
    weight: float = 1.0
    seq: int = 0
    start: float = 0.0
    finish: float = 0.0
    class_since: float = 0.0  # when it joined its class (promotion counts from here)
    queued: bool = False
    released: bool = False
    quiet: bool = False  # its tenant had nothing queued in its class when it came


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request leaves the queue without a slot: ``reason`` is ``queue_full``,
    ``tenant_queue_full``, ``preempted``, ``shed``, ``deadline`` (it could not be served in
    time: refused on arrival) or ``expired`` (its deadline came while it waited)."""
    reason: str
    retry_after_s: float


def _order(e: Entry) -> tuple[float, int]:
    return e.start, e.seq


class _Class:
    """One class's fair queue: each tenant's entries sorted by start tag."""
    __slots__ = ("tenants", "tags", "vtime", "arrivals", "inflight", "size")

    def __init__(self) -> None:
        self.tenants: dict[str, list[Entry]] = {}
        self.tags: dict[str, float] = {}  # each tenant's last finish tag
        self.vtime = 0.0
        self.arrivals: dict[Entry, None] = {}  # queued entries in the order they joined the class
        self.inflight = 0  # released here and not done
        self.size = 0

    def tag(self, e: Entry, credit: float) -> None:
        e.start = max(self.vtime - credit / e.weight, self.tags.get(e.tenant, 0.0))
        e.finish = e.start + e.cost / e.weight
        self.tags[e.tenant] = e.finish

    def untag(self, e: Entry) -> None:
        """A request that leaves unserved charges its tenant nothing (when it is the last one tagged)."""
        if self.tags.get(e.tenant) == e.finish:
            self.tags[e.tenant] = e.start

    def push(self, e: Entry) -> None:
        bisect.insort(self.tenants.setdefault(e.tenant, []), e, key=_order)
        self.arrivals[e] = None
        self.size += 1
        e.queued = True

    def remove(self, e: Entry) -> None:
        queue = self.tenants[e.tenant]
        queue.remove(e)
        if not queue:
            del self.tenants[e.tenant]
        del self.arrivals[e]
        self.size -= 1
        e.queued = False

    def head(self) -> Entry | None:
        heads = [q[0] for q in self.tenants.values()]
        return min(heads, key=_order) if heads else None

    def pop(self) -> Entry:
        e = self.head()
        assert e is not None
        self.remove(e)
        self.vtime = max(self.vtime, e.start)
        if len(self.tags) > TAGS_KEPT:  # bounded by the tenants still ahead of V
            self.tags = {t: f for t, f in self.tags.items() if f > self.vtime or t in self.tenants}
        return e

    def newest(self, tenant: str | None = None) -> Entry | None:
        """The newest queued entry: of ``tenant``, or of the tenant with the longest queue."""
        if tenant is None:
            if not self.tenants:
                return None
            tenant = max(self.tenants, key=lambda t: len(self.tenants[t]))
        queue = self.tenants.get(tenant)
        return queue[-1] if queue else None


class FairQueue:
    """One model's queued requests and its classes' slots in use (``done`` frees one)."""

    def __init__(self, rules: Rules, retry_after_s: float = 1.0):
        self.rules = rules
        self._retry_after_s = retry_after_s  # the hint when there is no estimate yet
        self._classes = [_Class() for _ in CLASSES]
        self._per_tenant: dict[str, int] = {}
        self._deadlines: list[tuple[float, int, Entry]] = []  # a heap; entries no longer queued are skipped
        self._seq = itertools.count()

    @property
    def queued(self) -> int:
        return sum(c.size for c in self._classes)

    def queued_in(self, klass: int) -> int:
        return self._classes[klass].size

    def inflight_in(self, klass: int) -> int:
        return self._classes[klass].inflight

    def tenant_queued(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def offer(self, e: Entry, now: float, free: int, total: int, rate: float | None = None,
              mean_cost: float = 0.0, tenant_rate: float | None = None) -> list[tuple[Entry, Refusal | None]]:
        """Queues ``e`` and releases what the ``free`` slots (of ``total``) allow. Returns each
        entry that left the queue: None for released, else why it was refused (``e`` among them
        when it was refused or released at once). ``rate``: the model's measured throughput in
        cost per second (None: not known yet), ``mean_cost``: a finished request's mean cost,
        ``tenant_rate``: the throughput ``e``'s tenant got (a backlogged tenant gets its share)."""
        e.seq, e.class_since = next(self._seq), now
        cls = self._classes[e.klass]
        cls.tag(e, self.rules.burst_tokens)
        e.quiet = e.tenant not in cls.tenants
        out: list[tuple[Entry, Refusal | None]] = []
        victim = self._room_for(e)
        if victim is None:
            cls.untag(e)
            return [(e, self._refusal_full(e, rate, mean_cost))]
        if victim is not e:
            self._drop(victim)
            out.append((victim, Refusal("preempted" if victim.klass < e.klass else "shed",
                                        self._estimate(victim, rate, mean_cost))))
        self._push(e)
        out += [(r, None) for r in self.release(free, total)]
        if e.queued and rate:
            wait = self._estimate(e, rate, mean_cost, tenant_rate)
            if now + wait > e.deadline:
                self._drop(e)
                out.append((e, Refusal("deadline", wait)))
        return out

    def _room_for(self, e: Entry) -> Entry | None:
        """``e`` itself when the bounds allow it, else the queued entry it displaces; None:
        there is no room for it."""
        rules = self.rules
        if self._per_tenant.get(e.tenant, 0) >= rules.max_queued_per_tenant:
            for k in range(e.klass):  # the tenant's own lower classes, lowest first
                if (v := self._classes[k].newest(e.tenant)) is not None:
                    return v
            return None
        if self.queued < rules.max_queued:
            return e
        for k in range(e.klass):  # a lower class, lowest first: the longest queue's newest
            if (v := self._classes[k].newest()) is not None:
                return v
        v = self._classes[e.klass].newest()  # the same class: the longest queue gives way to a shorter one
        mine = self._per_tenant.get(e.tenant, 0)
        return v if v is not None and v.tenant != e.tenant and self._per_tenant[v.tenant] > mine + 1 else None

    def _refusal_full(self, e: Entry, rate: float | None, mean_cost: float) -> Refusal:
        tenant_full = self._per_tenant.get(e.tenant, 0) >= self.rules.max_queued_per_tenant
        return Refusal("tenant_queue_full" if tenant_full else "queue_full", self._estimate(e, rate, mean_cost))

    def release(self, free: int, total: int) -> list[Entry]:
        """Takes entries off the queue for up to ``free`` slots: the highest class that may
        use a slot first (a class's unused reservation of ``total`` is not for the others),
        in fair order within it."""
        released: list[Entry] = []
        quiet = int(self.rules.quiet_share * total)
        while free > 0:
            unused = [max(0, int(self.rules.rule(k).reserved_share * total) - c.inflight)
                      for k, c in enumerate(self._classes)]
            held = sum(unused)
            for k in reversed(range(len(CLASSES))):
                cls = self._classes[k]
                if cls.size and free - (held - unused[k]) - (0 if cast(Entry, cls.head()).quiet else quiet) > 0:
                    e = cls.pop()
                    self._left(e)
                    e.released = True
                    cls.inflight += 1
                    released.append(e)
                    free -= 1
                    break
            else:
                break
        return released

    def done(self, e: Entry) -> None:
        """A released entry's request ended: its class's slot is free."""
        if e.released:
            e.released = False
            self._classes[e.klass].inflight -= 1

    def withdraw(self, e: Entry) -> None:
        """A queued entry's client went away."""
        if e.queued:
            self._drop(e)

    def expire(self, now: float) -> list[tuple[Entry, Refusal]]:
        """The queued entries whose deadline has come; they leave the queue."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, e = heapq.heappop(self._deadlines)
            if e.queued:
                self._drop(e)
                out.append((e, Refusal("expired", self._retry_after_s)))
        return out

    def next_deadline(self) -> float | None:
        while self._deadlines and not self._deadlines[0][2].queued:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def promote(self, now: float) -> list[Entry]:
        """Moves each entry queued in its class past the class's limit up one class."""
        moved = []
        for k in range(len(CLASSES) - 1):
            limit = self.rules.rule(k).promote_after_s
            if limit is None:
                continue
            cls, up = self._classes[k], self._classes[k + 1]
            for e in list(self._starved(cls, now - limit)):
                cls.remove(e)
                e.klass, e.class_since = k + 1, now
                e.start = up.vtime  # at the front of the fair order: it waited long enough
                e.finish = e.start + e.cost / e.weight
                up.tags[e.tenant] = max(up.tags.get(e.tenant, 0.0), e.finish)
                up.push(e)
                moved.append(e)
        return moved

    @staticmethod
    def _starved(cls: _Class, joined_before: float) -> Iterator[Entry]:
        for e in cls.arrivals:  # oldest first
            if e.class_since > joined_before:
                return
            yield e

    def _estimate(self, e: Entry, rate: float | None, mean_cost: float, tenant_rate: float | None = None) -> float:
        """Seconds until a queued ``e`` gets a slot: the cost queued ahead of it (higher
        classes, and its own class before it in fair order) plus one request's, over ``rate``;
        at least its own tenant's cost ahead of it over what that tenant is being served at."""
        if not rate:
            return self._retry_after_s
        ahead = sum(x.cost for c in self._classes[e.klass + 1:] for x in c.arrivals)
        mine = 0.0
        for x in self._classes[e.klass].arrivals:
            if x is not e and _order(x) < _order(e):
                ahead += x.cost
                mine += x.cost if x.tenant == e.tenant else 0.0
        wait = (ahead + (mean_cost or e.cost)) / rate
        return max(wait, (mine + e.cost) / tenant_rate) if mine and tenant_rate else wait

    def _push(self, e: Entry) -> None:
        self._classes[e.klass].push(e)
        self._per_tenant[e.tenant] = self._per_tenant.get(e.tenant, 0) + 1
        if len(self._deadlines) > 2 * self.queued + 1024:  # released entries' deadlines: dropped
            self._deadlines = [d for d in self._deadlines if d[2].queued]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (e.deadline, e.seq, e))

    def _drop(self, e: Entry) -> None:
        cls = self._classes[e.klass]
        cls.remove(e)
        cls.untag(e)
        self._left(e)

    def _left(self, e: Entry) -> None:
        n = self._per_tenant[e.tenant] - 1
        if n:
            self._per_tenant[e.tenant] = n
        else:
            del self._per_tenant[e.tenant]


class Throughput:
    """A model's measured throughput, from its finished requests: their cost per second over
    the last ``window_s`` (at most ``keep`` requests), and a finished request's mean cost."""

    def __init__(self, window_s: float = 30.0, keep: int = 4096, min_samples: int = 4):
        self._window_s = window_s
        self._keep = keep
        self._min = min_samples
        self._done: list[tuple[float, float]] = []  # (when, cost), oldest first
        self._first = 0
        self._sum = 0.0

    def record(self, now: float, cost: float) -> None:
        self._done.append((now, cost))
        self._sum += cost
        self._trim(now)

    def _trim(self, now: float) -> None:
        done = self._done
        while self._first < len(done) and (len(done) - self._first > self._keep
                                           or done[self._first][0] < now - self._window_s):
            self._sum -= done[self._first][1]
            self._first += 1
        if self._first > 1024 and self._first * 2 > len(done):
            del done[:self._first]
            self._first = 0

    def samples(self) -> int:
        return len(self._done) - self._first

    def rate(self, now: float) -> float | None:
        """Cost per second; None until ``min_samples`` requests finished within the window."""
        self._trim(now)
        n = self.samples()
        if n < self._min:
            return None
        span = max(now - self._done[self._first][0], 1e-3)
        return (self._sum - self._done[self._first][1]) / span if n > 1 else None

    def mean_cost(self) -> float:
        n = self.samples()
        return self._sum / n if n else 0.0

"""Active-active gateways' one view of in-flight load (issue 32): every gateway process (a
worker or a replica) publishes its load ledger's counts per endpoint, and sums the others'
into ``LocalState.peers``, so each routes on what every gateway sent and has not seen start
or end, not on its own share and the engines' lagging reports. Pure: the publishing and
reading go through ``ledger_share``.

A peer counts once its snapshot has changed while we watched (each carries a sequence number),
or once it pushed one (a push is live: the channel keeps nothing), and while it keeps changing:
one unchanged for ``STALE_ROUNDS`` of its own publishing interval (at least ``MIN_STALE_S``) by
our clock is left out, so no clocks are compared across hosts and a killed process's last
snapshot is never counted by one that starts after it. A field that
stays unchanged (or unreadable) for ``FORGET_S`` (or three times its staleness) is dropped from
the store; an unreadable one is never counted (a newer version's, or junk) nor dropped while it
changes. What is read is bounded: a
snapshot's size, its endpoints, each count."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmesh.gateway.upstream.picking.types import PEER_COUNTS, LocalState

VERSION = 1
MAX_BYTES = 256 * 1024     # a snapshot larger than this is not read
MAX_ENDPOINTS = 4096       # endpoints read from one snapshot; more are ignored (a bound, not a fleet size)
MAX_COUNT = 1 << 31        # a count at or over this is not a count
MIN_STALE_S = 1.0
MAX_STALE_S = 30.0
STALE_ROUNDS = 20
FORGET_S = 60.0


def snapshot(local: LocalState, seq: int, interval_s: float) -> str:
    """This gateway's own ledger as published (each endpoint by its ``shared_name``):
    ``{"v", "s": seq, "i": interval_s, "e": {endpoint:
    [counts...]}, "r": {endpoint: [since_report, running, waiting]}}``: the counts in
    ``PEER_COUNTS`` order, endpoints with nothing in flight left out; and the requests it started
    less those it ended since the report it last saw of an endpoint, with that report's running
    and waiting (a peer adds them only while its own last report of the endpoint says the same)."""
    tables = [getattr(local, name) for name in PEER_COUNTS]
    counts = {local.shared_name(eid): [t.get(eid, 0) for t in tables] for eid in sorted(set().union(*tables))}
    since = {local.shared_name(eid): [n, *local.reported.get(eid, (0, 0))]
             for eid, n in sorted(local.since_report.items()) if n}
    return json.dumps({"v": VERSION, "s": seq, "i": interval_s, "e": {e: c for e, c in counts.items() if any(c)},
                       "r": since}, separators=(",", ":"))


def _count(v: object) -> bool:
    return type(v) is int and 0 <= v < MAX_COUNT


@dataclass(frozen=True, slots=True)
class Snapshot:
    seq: int
    interval_s: float
    counts: dict[str, tuple[int, ...]]
    since: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # since_report, running, waiting


def parse(raw: bytes | str) -> Snapshot | None:
    """A peer's snapshot of this version, or None (junk, too large, another version). An
    endpoint whose counts are not ``len(PEER_COUNTS)`` ints in [0, 2**31) is skipped."""
    if len(raw) > MAX_BYTES:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        return None
    seq, interval, endpoints = doc.get("s"), doc.get("i"), doc.get("e")
    if type(seq) is not int or not isinstance(endpoints, dict):
        return None
    if not isinstance(interval, (int, float)) or isinstance(interval, bool) or not 0 < interval <= 60:
        return None  # finite too: NaN and the infinities fail the range
    counts: dict[str, tuple[int, ...]] = {}
    for n, (eid, values) in enumerate(endpoints.items()):
        if n == MAX_ENDPOINTS:
            break
        if isinstance(values, list) and len(values) == len(PEER_COUNTS) and all(_count(v) for v in values):
            counts[eid] = tuple(values)
    return Snapshot(seq, float(interval), counts, _since(doc.get("r")))


def _since(r: object) -> dict[str, tuple[int, int, int]]:
    out: dict[str, tuple[int, int, int]] = {}
    if isinstance(r, dict):
        for n, (eid, v) in enumerate(r.items()):
            if n == MAX_ENDPOINTS:
                break
            if (isinstance(v, list) and len(v) == 3 and type(v[0]) is int and -MAX_COUNT < v[0] < MAX_COUNT
                    and _count(v[1]) and _count(v[2])):
                out[eid] = (v[0], v[1], v[2])
    return out


@dataclass(slots=True)
class _Seen:
    mark: object           # the snapshot's sequence number, or the raw value of one not readable
    changed_at: float
    changed: bool = False  # has changed while we watched
    snap: Snapshot | None = None

    @property
    def stale_s(self) -> float:
        interval = self.snap.interval_s if self.snap is not None else MIN_STALE_S / STALE_ROUNDS
        return min(max(MIN_STALE_S, STALE_ROUNDS * interval), MAX_STALE_S)


@dataclass(slots=True)
class PeerLoads:
    """Reads the published snapshots: ``me`` is this gateway's own field in the store."""
    me: str
    _seen: dict[str, _Seen] = field(default_factory=dict)
    live: int = 0  # peers counted by the last ``sums``
    others: int = 0  # other fields in the store at the last ``update``, counted or not

    def update(self, published: Mapping[bytes | str, bytes | str], now: float) -> tuple[
            dict[str, tuple[int, ...]], list[str]]:
        """The store's fields read (every peer's last snapshot): the live peers' counts summed per
        endpoint, and the fields to drop from the store."""
        forget: list[str] = []
        names: set[str] = set()
        for key, raw in published.items():
            name = key.decode(errors="replace") if isinstance(key, bytes) else key
            if name == self.me:
                continue
            names.add(name)
            seen = self._see(name, raw, parse(raw), now)
            if now - seen.changed_at >= max(FORGET_S, 3 * seen.stale_s):
                forget.append(name)
        for name in (set(self._seen) - names) | set(forget):
            del self._seen[name]
        self.others = len(names) - len(forget)
        return self.sums(now), forget

    def offer(self, name: str, raw: bytes | str, now: float) -> None:
        """A snapshot a peer pushed between rounds: taken when it is newer than the one held. A
        push is sent as it arrives (the channel keeps nothing), so its sender is alive now and
        counts at once: no wait for a change (a round that read the store just before the
        sender's first write would otherwise leave a new peer out for a round or more)."""
        snap = parse(raw)
        if name != self.me and snap is not None:
            self._see(name, raw, snap, now, pushed=True)

    def _live(self, now: float) -> list[Snapshot]:
        return [seen.snap for seen in self._seen.values()
                if seen.snap is not None and seen.changed and now - seen.changed_at < seen.stale_s]

    def since(self, now: float) -> dict[str, tuple[tuple[int, int, int], ...]]:
        """The live peers' requests started less ended since a report, per endpoint, each with
        that report's running and waiting."""
        out: dict[str, list[tuple[int, int, int]]] = {}
        for snap in self._live(now):
            for eid, v in snap.since.items():
                out.setdefault(eid, []).append(v)
        return {eid: tuple(v) for eid, v in out.items()}

    def sums(self, now: float) -> dict[str, tuple[int, ...]]:
        """The live peers' counts summed per endpoint."""
        sums: dict[str, list[int]] = {}
        live = self._live(now)
        self.live = len(live)
        for snap in live:
            for eid, values in snap.counts.items():
                total = sums.setdefault(eid, [0] * len(PEER_COUNTS))
                for n, v in enumerate(values):
                    total[n] += v
        return {eid: tuple(v) for eid, v in sums.items()}

    def _see(self, name: str, raw: bytes | str, snap: Snapshot | None, now: float,
             pushed: bool = False) -> _Seen:
        seen = self._seen.get(name)
        if snap is not None and seen is not None and seen.snap is not None and snap.seq < seen.snap.seq:
            return seen  # a push already brought a newer one
        mark = snap.seq if snap is not None else ("raw", hash(raw))
        if seen is None:
            seen = self._seen[name] = _Seen(mark, now, changed=pushed)
        elif seen.mark != mark or pushed:
            seen.mark, seen.changed_at, seen.changed = mark, now, True
        seen.snap = snap
        return seen

"""Active-active gateways' one view of in-flight load (issue 32): every gateway process (a
worker or a replica) publishes its load ledger's counts per endpoint, and sums the others'
into ``LocalState.peers``, so each routes on what every gateway sent and has not seen start
or end, not on its own share and the engines' lagging reports. Pure: the publishing and
reading go through ``ledger_share``.

A peer is alive while its snapshot keeps changing (each one carries a sequence number): one
that has not changed for ``stale_s`` by our own clock is left out, so no clocks are compared
across hosts, and after ``forget_s`` its snapshot is dropped from the store."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmesh.gateway.upstream.picking.types import PEER_COUNTS, LocalState

MAX_ENDPOINTS = 4096  # endpoints read from one peer's snapshot; more are ignored (a bound, not a fleet size)


def snapshot(local: LocalState, seq: int) -> str:
    """This gateway's own ledger as published: ``{"s": seq, "e": {endpoint: [counts...]}}`` in
    ``PEER_COUNTS`` order, endpoints with nothing in flight left out."""
    tables = [getattr(local, name) for name in PEER_COUNTS]
    eids = set().union(*tables)
    counts = {eid: [t.get(eid, 0) for t in tables] for eid in sorted(eids)}
    return json.dumps({"s": seq, "e": {eid: c for eid, c in counts.items() if any(c)}}, separators=(",", ":"))


_SIGNED = PEER_COUNTS.index("since_report")  # requests finished since a report: may be below zero


def _parse(raw: bytes | str) -> tuple[int, dict[str, tuple[int, ...]]] | None:
    """A peer's snapshot, or None when it is not one (each count an int, only ``since_report``
    below zero)."""
    try:
        doc = json.loads(raw)
        seq, endpoints = int(doc["s"]), doc["e"]
        out: dict[str, tuple[int, ...]] = {}
        for eid, counts in list(endpoints.items())[:MAX_ENDPOINTS]:
            if isinstance(counts, list) and len(counts) == len(PEER_COUNTS):
                values = tuple(int(c) for c in counts)
                if all(v >= 0 or n == _SIGNED for n, v in enumerate(values)):
                    out[str(eid)] = values
        return seq, out
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


@dataclass(slots=True)
class _Seen:
    seq: int
    changed_at: float


@dataclass(slots=True)
class PeerLoads:
    """Reads the published snapshots: ``me`` is this gateway's own field in the store."""
    me: str
    stale_s: float = 1.0
    forget_s: float = 60.0
    _seen: dict[str, _Seen] = field(default_factory=dict)

    def update(self, published: Mapping[bytes | str, bytes | str], now: float) -> tuple[
            dict[str, tuple[int, ...]], list[str]]:
        """The live peers' counts summed per endpoint, and the peers to drop from the store
        (unchanged for ``forget_s``, or not a snapshot)."""
        sums: dict[str, list[int]] = {}
        forget: list[str] = []
        names: set[str] = set()
        for key, raw in published.items():
            name = key.decode() if isinstance(key, bytes) else key
            if name == self.me:
                continue
            names.add(name)
            parsed = _parse(raw)
            if parsed is None:
                forget.append(name)
                continue
            seq, counts = parsed
            seen = self._seen.get(name)
            if seen is None or seen.seq != seq:
                # a peer first seen counts from now: one that is dead already lapses after stale_s
                seen = self._seen[name] = _Seen(seq, now)
            if now - seen.changed_at >= self.forget_s:
                forget.append(name)
            if now - seen.changed_at >= self.stale_s:
                continue
            for eid, values in counts.items():
                total = sums.setdefault(eid, [0] * len(PEER_COUNTS))
                for n, v in enumerate(values):
                    total[n] += v
        for name in set(self._seen) - names:
            del self._seen[name]
        for name in forget:
            self._seen.pop(name, None)
        return {eid: tuple(v) for eid, v in sums.items()}, forget

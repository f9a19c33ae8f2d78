"""Node health for routing: a node whose GPU ECC error count rises, whose self-test
fails, or whose self-test latency drifts well above its peers' is degraded and gets
no new work until it recovers (ECC quiet for a while, the self-test passing again,
the latency back near its peers'). Pure; the clock is passed in."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NodeSignals:
    ecc_errors: int = 0           # corrected + uncorrected, summed over the node's GPUs
    self_test_ok: bool = True
    self_test_detail: str = ""
    latency_ms: float = 0.0       # the last self-test's; 0: not measured yet


class HealthJudge:
    def __init__(self, ecc_quiet_s: float = 300.0, drift_factor: float = 3.0, drift_min_ms: float = 50.0,
                 drift_min_peers: int = 2):
        self._quiet = ecc_quiet_s
        self._factor = drift_factor
        self._min_ms = drift_min_ms
        # With one peer there is no telling which of the two drifted: a self-test that ran while
        # the machine was busy (an engine skips its test while it serves, so a busy engine keeps
        # its idle figure) would take the idle, healthy one out of routing.
        self._min_peers = drift_min_peers
        self._ecc: dict[str, int] = {}
        self._ecc_rose_at: dict[str, float] = {}

    def forget(self, endpoint_id: str) -> None:
        self._ecc.pop(endpoint_id, None)
        self._ecc_rose_at.pop(endpoint_id, None)

    def judge(self, endpoint_id: str, s: NodeSignals, now: float, peer_latencies_ms: list[float]) -> str:
        """Why the node is degraded, or "" when it is fine. The first count seen is the
        baseline: errors from before the engine came are not a rise."""
        before = self._ecc.get(endpoint_id)
        self._ecc[endpoint_id] = s.ecc_errors
        if before is not None and s.ecc_errors > before:
            self._ecc_rose_at[endpoint_id] = now
        reasons = []
        rose = self._ecc_rose_at.get(endpoint_id)
        if rose is not None and now - rose < self._quiet:
            reasons.append(f"GPU ECC errors rising (now {s.ecc_errors}); out of routing until quiet "
                           f"for {self._quiet:g} s")
        if not s.self_test_ok:
            reasons.append(f"self-test failed: {s.self_test_detail or 'no detail'}")
        peers = [p for p in peer_latencies_ms if p > 0]
        if s.latency_ms > 0 and len(peers) >= self._min_peers:
            median = statistics.median(peers)
            if s.latency_ms > self._factor * median and s.latency_ms - median > self._min_ms:
                reasons.append(f"self-test latency {s.latency_ms:.0f} ms, {s.latency_ms / median:.1f}x "
                               f"its peers' median {median:.0f} ms")
        return "; ".join(reasons)

"""Circuit breakers and the retry budget as pure state machines (clock passed in)."""

from dataclasses import replace

from llmesh.liveconfig.schema import CircuitBreaker, RetryBudget
from llmesh.gateway.upstream.resilience import Breakers, BreakerState, RetryBudgetGate


def breakers(**cfg):
    moves = []
    b = Breakers(lambda: CircuitBreaker(**cfg), on_state=lambda e, s: moves.append((e, s)))
    return b, moves


def test_consecutive_failures_open_then_a_probe_closes():
    b, moves = breakers(failure_threshold=3, reset_after_s=5)
    for t in range(2):
        b.record("a", False, None, float(t))
    assert b.refusing(2.0) == frozenset()
    b.record("a", False, None, 2.0)
    assert b.refusing(2.1) == {"a"}
    assert b.state("a", 6.9) is BreakerState.OPEN
    assert b.state("a", 7.0) is BreakerState.HALF_OPEN and b.refusing(7.0) == frozenset()
    b.attempt("a", 7.0)
    assert b.refusing(7.1) == {"a"}  # one probe at a time
    b.record("a", True, 0.1, 7.2)
    assert b.state("a", 7.2) is BreakerState.CLOSED and b.refusing(7.2) == frozenset()
    assert moves == [("a", BreakerState.OPEN), ("a", BreakerState.HALF_OPEN), ("a", BreakerState.CLOSED)]


def test_a_failed_probe_opens_again():
    b, _ = breakers(failure_threshold=1, reset_after_s=1)
    b.record("a", False, None, 0.0)
    b.attempt("a", 1.5)
    b.record("a", False, None, 1.6)
    assert b.state("a", 2.0) is BreakerState.OPEN
    assert b.state("a", 2.6) is BreakerState.HALF_OPEN


def test_error_rate_over_the_window_opens():
    b, _ = breakers(failure_threshold=100, min_requests=10, error_rate=0.2, window_s=30)
    for i in range(10):  # alternating: never 100 in a row, 50 % errors
        b.record("a", i % 2 == 0, 0.1, float(i))
        if i < 9:
            assert b.state("a", float(i)) is BreakerState.CLOSED
    assert b.state("a", 9.0) is BreakerState.OPEN


def test_old_outcomes_leave_the_window():
    b, _ = breakers(failure_threshold=100, min_requests=10, error_rate=0.2, window_s=5)
    for i in range(9):
        b.record("a", False, None, float(i) * 10)  # each alone in its window
    b.record("a", True, 0.1, 100.0)
    assert b.state("a", 100.0) is BreakerState.CLOSED


def test_p99_latency_over_the_limit_opens():
    b, _ = breakers(min_requests=10, latency_p99_s=5.0)
    for i in range(9):
        b.record("a", True, 0.2, float(i))
    b.record("a", True, 7.0, 9.0)
    assert b.state("a", 9.0) is BreakerState.OPEN


def test_a_disabled_breaker_refuses_nothing():
    b, _ = breakers(enabled=False, failure_threshold=1)
    b.record("a", False, None, 0.0)
    assert b.refusing(0.0) == frozenset()


def test_retry_budget_caps_retries_at_the_ratio_plus_burst():
    gate = RetryBudgetGate(lambda: RetryBudget(ratio=0.2, burst=3))
    granted = 0
    for _ in range(100):
        gate.deposit()
        while gate.spend():  # a failing fleet: every request wants every retry it can get
            granted += 1
    assert 20 <= granted <= 23


def test_retry_budget_pays_a_burst_from_what_the_window_saved_then_forgets():
    now = [0.0]
    gate = RetryBudgetGate(lambda: RetryBudget(ratio=0.2, burst=10), clock=lambda: now[0])
    for i in range(500):  # 5 s of steady traffic, 100 requests a second
        now[0] = i / 100
        gate.deposit()
    # One engine of three dies: a third of the requests in flight need another engine at once.
    assert sum(gate.spend() for _ in range(60)) == 60
    now[0] = 30.0  # long after: the window forgot that traffic, and a failing fleet gets burst + ratio
    granted = 0
    for _ in range(50):
        gate.deposit()
        while gate.spend():
            granted += 1
    assert granted <= 10 + 0.2 * 50 + 1


def test_metrics_follow_breakers_fallbacks_and_the_budget():
    from prometheus_client import CollectorRegistry
    from llmesh.gateway.metrics import GatewayMetrics
    from llmesh.gateway.record import RequestRecord
    registry = CollectorRegistry()
    m = GatewayMetrics(registry, known=lambda model: True)
    b = Breakers(lambda: CircuitBreaker(failure_threshold=1),
                 on_state=lambda e, s: m.breaker.labels(e).set(int(s)))
    b.record("e1", False, None, 0.0)
    assert registry.get_sample_value("llmesh_circuit_breaker_state", {"endpoint": "e1"}) == 1
    base = RequestRecord(model="b", tenant="t", duration_ms=5.0, endpoint="e2", ttft_ms=1.0, prompt_tokens=1,
                         completion_tokens=1, retries=1)
    m.observe(replace(base, fallback="b"))
    m.observe(replace(base, status="unavailable", retry_budget_exhausted=True))
    assert registry.get_sample_value("llmesh_fallbacks_total", {"model": "b"}) == 1
    assert registry.get_sample_value("llmesh_retry_budget_exhausted_total") == 1

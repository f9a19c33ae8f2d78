"""The health judge on plain signals: ECC errors rising, a failed self-test and
latency drifting far above peers degrade a node; each recovers."""

from llmesh.scheduler.health import HealthJudge, NodeSignals


def test_ecc_rise_degrades_until_the_count_stays_quiet():
    j = HealthJudge(ecc_quiet_s=60)
    assert j.judge("a", NodeSignals(ecc_errors=7), 0, []) == ""          # errors from before: the baseline
    assert j.judge("a", NodeSignals(ecc_errors=7), 10, []) == ""
    why = j.judge("a", NodeSignals(ecc_errors=9), 20, [])
    assert "ECC errors rising" in why and "9" in why
    assert j.judge("a", NodeSignals(ecc_errors=9), 79, []) != ""
    assert j.judge("a", NodeSignals(ecc_errors=9), 81, []) == ""
    j.forget("a")
    assert j.judge("a", NodeSignals(ecc_errors=50), 90, []) == ""        # a new engine: a new baseline


def test_failed_self_test_degrades_until_it_passes():
    j = HealthJudge()
    assert j.judge("a", NodeSignals(self_test_ok=False, self_test_detail="NaN logits"), 0, []) == \
        "self-test failed: NaN logits"
    assert j.judge("a", NodeSignals(), 1, []) == ""


def test_latency_far_above_peers_degrades_small_drifts_do_not():
    j = HealthJudge(drift_factor=3.0, drift_min_ms=50)
    assert "4.0x its peers' median 100 ms" in j.judge("a", NodeSignals(latency_ms=400), 0, [90, 100, 110])
    assert j.judge("a", NodeSignals(latency_ms=250), 1, [90, 100, 110]) == ""     # under 3x
    assert j.judge("a", NodeSignals(latency_ms=30), 2, [5, 6, 7]) == ""           # 5x, but only 24 ms
    assert j.judge("a", NodeSignals(latency_ms=400), 3, []) == ""                 # no peers: no drift
    assert j.judge("a", NodeSignals(latency_ms=400), 4, [0.0]) == ""              # peers not measured yet


def test_one_peer_is_no_measure_of_drift():
    """Two engines: the idle one's self-test ran while the busy one served (a busy engine skips its
    test and keeps its idle figure), so the idle one looks slow. Judged only with two peers or more."""
    j = HealthJudge(drift_factor=3.0, drift_min_ms=50)
    assert j.judge("idle", NodeSignals(latency_ms=900), 0, [100]) == ""
    assert "9.0x" in j.judge("idle", NodeSignals(latency_ms=900), 1, [100, 100])
    assert "9.0x" in HealthJudge(drift_min_peers=1).judge("idle", NodeSignals(latency_ms=900), 2, [100])


def test_status_says_why_a_node_is_degraded():
    from llmesh.cli.status import render
    e = {"endpoint_id": "engine-3", "backend": "vllm", "models": ["m"], "running": 0, "waiting": 0, "healthy": True,
         "degraded": "GPU ECC errors rising (now 5)",
         "hardware": {"cpu_cores": 8, "memory_total_bytes": 2**34, "gpus": [{"name": "H100"}]},
         "self_test": {"ok": True, "detail": "", "latency_ms": 20.0}}
    report = {"gateway_http": "http://x", "services": [], "endpoints": [e], "models": [],
              "live": {"requests_per_s": None, "requests_total": None, "ttft_ms_p50": None, "ttft_ms_p99": None,
                       "engines": []}}
    assert "engine-3         DEGRADED, no new work: GPU ECC errors rising (now 5)" in render(report, as_json=False)
    assert '"degraded": "GPU ECC errors rising (now 5)"' in render(report, as_json=True)

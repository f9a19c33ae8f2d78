"""The per-request record's access-log view: the core fields always, the others only
when they happened (as the dict it replaced logged them)."""

from llmesh.gateway.record import RequestRecord


def test_a_plain_request_logs_only_the_core():
    r = RequestRecord(model="m", tenant="t", endpoint="e1", ttft_ms=1.5, prompt_tokens=3, completion_tokens=4,
                      duration_ms=9.0)
    assert r.log_fields() == {"model": "m", "tenant": "t", "endpoint": "e1", "cache": "skip", "status": "ok",
                              "ttft_ms": 1.5, "prompt_tokens": 3, "completion_tokens": 4, "retries": 0,
                              "duration_ms": 9.0}


def test_what_happened_is_logged_and_nothing_else():
    r = RequestRecord(model="m", tenant="t", status="resource_exhausted", reason="queue_full", failovers=1,
                      breaker_panic=True, retry_budget_exhausted=True, pii={"email": 1}, caller="key1",
                      finish_reason="length", cost_usd=0.25)
    fields = r.log_fields()
    assert fields["endpoint"] is None and fields["ttft_ms"] is None  # core: present even when empty
    assert {k: fields[k] for k in ("reason", "failovers", "breaker_panic", "retry_budget_exhausted", "pii",
                                   "caller", "finish_reason", "cost_usd")} == {
        "reason": "queue_full", "failovers": 1, "breaker_panic": True, "retry_budget_exhausted": True,
        "pii": {"email": 1}, "caller": "key1", "finish_reason": "length", "cost_usd": 0.25}
    assert not {"fallback", "limits", "injection_score", "injection_rules", "policy"} & fields.keys()
    assert RequestRecord(model="m", tenant="t", cost_usd=0.0).log_fields()["cost_usd"] == 0.0  # a value, not absent

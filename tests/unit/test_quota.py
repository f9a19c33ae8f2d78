"""The limits stage's pure parts: OpenAI's reset format, headers, prices, periods."""

from __future__ import annotations

from datetime import datetime, timezone

from llmesh.liveconfig.schema import Price, RateLimit
from llmesh.gateway.domain.limits import Verdict
from llmesh.gateway.domain.quota import Periods, duration, micro_usd, period_bounds, ratelimit_headers


def test_reset_durations_read_like_openais():
    assert [duration(ms) for ms in (0, 20, 999, 1000, 1001, 59_000, 60_000, 360_000)] == [
        "0ms", "20ms", "999ms", "1s", "2s", "59s", "1m0s", "6m0s"]


def test_headers_say_limit_remaining_and_reset_per_kind():
    v = Verdict(True, requests_used=3, tokens_used=700, requests_reset_ms=1500, tokens_reset_ms=20)
    h = ratelimit_headers(RateLimit(requests_per_minute=10, tokens_per_minute=1000), v)
    assert h == {"x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "7",
                 "x-ratelimit-reset-requests": "2s", "x-ratelimit-limit-tokens": "1000",
                 "x-ratelimit-remaining-tokens": "300", "x-ratelimit-reset-tokens": "20ms"}
    assert ratelimit_headers(None, v) == {}
    assert "x-ratelimit-limit-tokens" not in ratelimit_headers(RateLimit(requests_per_minute=5), v)


def test_prices_are_per_thousand_tokens_in_micro_dollars():
    assert micro_usd(Price(input_per_1k=0.5, output_per_1k=1.5), 1000, 2000) == 3_500_000
    assert micro_usd(None, 1000, 1000) == 0


def test_periods_are_utc_days_and_months():
    noon = datetime(2026, 2, 14, 12, 0, tzinfo=timezone.utc).timestamp()
    assert period_bounds("day", noon) == ("2026-02-14", datetime(2026, 2, 15, tzinfo=timezone.utc).timestamp())
    assert period_bounds("month", noon) == ("2026-02", datetime(2026, 3, 1, tzinfo=timezone.utc).timestamp())
    periods = Periods()
    assert periods("day", noon)[0] == "2026-02-14"
    assert periods("day", noon + 12 * 3600)[0] == "2026-02-15"  # worked out again once the day ends

"""What a cache hit saved, piece by piece: the record the cache stage writes, the usage hash's
fields, the gateway's counters and ``llmesh usage``'s table and CSV."""

from __future__ import annotations

import csv
import io

from prometheus_client import CollectorRegistry

from llmesh.cli.governance import _print_usage, _row
from llmesh.liveconfig.schema import Price
from llmesh.types import Finish, FinishReason, Usage
from llmesh.gateway.context import CacheHit
from llmesh.gateway.domain.limits import Outcome, usage_fields
from llmesh.gateway.metrics import GatewayMetrics
from llmesh.gateway.record import RequestRecord
from llmesh.gateway.stages.cache import saved


def hit(prompt: int, completion: int, kind: str = "semantic") -> CacheHit:
    return CacheHit("Use the reset link.", Finish(FinishReason.STOP, Usage(prompt, completion)), kind)


def test_a_hit_spends_nothing_and_saves_the_cached_answers_tokens_at_the_models_price():
    record = RequestRecord(model="m", tenant="acme")
    saved(record, hit(1000, 500), Price(input_per_1k=0.5, output_per_1k=1.5))
    assert (record.cache, record.cache_kind) == ("hit", "semantic")
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)
    assert (record.saved_prompt_tokens, record.saved_completion_tokens) == (1000, 500)
    assert record.saved_usd == 0.5 + 0.75
    unpriced = RequestRecord(model="m", tenant="acme")
    saved(unpriced, hit(10, 5, "exact"), None)  # no price in live config: tokens saved, no money
    assert unpriced.saved_usd == 0.0 and unpriced.saved_prompt_tokens == 10
    assert {"cache_kind", "saved_prompt_tokens", "saved_completion_tokens", "saved_usd"} <= record.log_fields().keys()
    assert "saved_usd" not in RequestRecord(model="m", tenant="acme").log_fields()


def test_usage_fields_add_the_saving_only_for_a_hit():
    miss = usage_fields("acme", Outcome("m", "2026-12-03", 10, 20, 300))
    assert sorted(k.split("\t")[2] for k in miss) == ["completion_tokens", "micro_usd", "prompt_tokens", "requests"]
    fields = usage_fields("acme", Outcome("m", "2026-12-03", 0, 0, 0, cache_hit=True, saved_prompt_tokens=10,
                                          saved_completion_tokens=20, saved_micro=300))
    assert fields["acme\tm\tcache_hits"] == 1 and fields["acme\tm\tsaved_micro_usd"] == 300
    assert fields["acme\tm\tsaved_prompt_tokens"] == 10 and fields["acme\tm\tsaved_completion_tokens"] == 20
    assert fields["acme\tm\tprompt_tokens"] == 0 and fields["acme\tm\tmicro_usd"] == 0


def test_the_gateway_counts_saved_tokens_and_money_per_model_and_kind():
    metrics = GatewayMetrics(CollectorRegistry(), lambda model: model == "m")
    for kind, (p, c) in (("exact", (10, 20)), ("semantic", (3, 4)), ("exact", (1, 1))):
        record = RequestRecord(model="m", tenant="acme")
        saved(record, hit(p, c, kind), Price(input_per_1k=1.0, output_per_1k=2.0))
        metrics.observe(record)
    failed = RequestRecord(model="m", tenant="acme", status="internal")
    saved(failed, hit(100, 100, "exact"), None)
    metrics.observe(failed)  # a hit whose answer did not reach the client saved nothing
    metrics.observe(RequestRecord(model="m", tenant="acme", cache="miss", prompt_tokens=5))
    tokens = metrics.cache_saved_tokens
    assert tokens.labels("m", "exact")._value.get() == 32
    assert tokens.labels("m", "semantic")._value.get() == 7
    usd = metrics.cache_saved_usd.labels("m", "exact")._value.get()
    assert abs(usd - (0.010 + 0.040 + 0.001 + 0.002)) < 1e-9


def test_llmesh_usage_shows_hits_and_savings(capsys):
    row = _row("2026-12-03", "acme", "m") | {"requests": 3, "prompt_tokens": 10, "completion_tokens": 12,
                                              "cost_usd": 0.092, "cache_hits": 2, "saved_prompt_tokens": 20,
                                              "saved_completion_tokens": 24, "saved_usd": 0.184}
    _print_usage([row], as_csv=True)
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert rows[0]["cache_hits"] == "2" and rows[0]["saved_usd"] == "0.184"
    assert rows[0]["saved_prompt_tokens"] == "20" and rows[0]["cost_usd"] == "0.092"
    _print_usage([row], as_csv=False)
    header, line = capsys.readouterr().out.splitlines()
    assert "cache hits" in header and "saved $" in header
    assert line.split()[-3:] == ["2", "44", "0.184000"]

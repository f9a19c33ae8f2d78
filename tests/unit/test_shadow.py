"""Shadow records, similarity, the bounded file store, the report, and the live
config's shadow and cascade sections."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from llmesh.liveconfig.schema import MeshConfig
from llmesh.shadow import Answer, FileShadowStore, ShadowRecord, report, similarity, text_hash
from llmesh.gateway.stages.cascade import cost_usd, mean_logprob
from llmesh.gateway.stages.shadow import sampled
from llmesh.liveconfig.schema import Price
from llmesh.types import Usage


def answer(model: str, latency: float, tokens: int = 10, text: str = "x", status: str = "ok") -> Answer:
    return Answer(model=model, status=status, latency_ms=latency, ttft_ms=latency / 2, prompt_tokens=5,
                  completion_tokens=tokens, chars=len(text), hash=text_hash(text))


def test_similarity_is_word_level_and_order_aware():
    assert similarity("The sky is blue.", "the sky is blue.") == 1.0
    assert similarity("", "") == 1.0
    assert similarity("alpha beta", "") == 0.0
    assert similarity("red green blue", "blue green red") < similarity("red green blue", "red green blue yellow")
    assert 0.5 < similarity("Paris is the capital of France.", "Paris is the capital city of France.") < 1.0


def test_sampling_is_stable_per_request_and_near_the_share():
    chosen = [sampled(f"req-{i}", 0.3) for i in range(4000)]
    assert chosen == [sampled(f"req-{i}", 0.3) for i in range(4000)]
    assert 0.27 < sum(chosen) / len(chosen) < 0.33
    assert all(sampled(f"req-{i}", 1.0) for i in range(50))


def test_report_quantiles_similarity_and_differences():
    records = [ShadowRecord(ts=100 + i, alias="a", primary=answer("m1", 10 * (i + 1), text="same"),
                            shadow=answer("m2", 100 * (i + 1), tokens=20, text="same" if i % 2 else f"other {i}"),
                            similarity=1.0 if i % 2 else 0.25) for i in range(20)]
    failed = ShadowRecord(ts=200, alias="a", primary=answer("m1", 5), shadow=answer("m2", 9000, status="unavailable"),
                          similarity=None)
    r = report("a", [*records, failed], drops=7, now=0)
    assert (r["count"], r["compared"], r["dropped"]) == (21, 20, 7)
    assert r["primary"]["latency_p50_ms"] == 100 and r["primary"]["latency_p95_ms"] == 190
    assert r["shadow"]["latency_p50_ms"] == 1000 and r["shadow"]["latency_p95_ms"] == 1900  # the failure is no latency
    assert r["shadow"]["errors"] == 1 and r["primary"]["errors"] == 0
    assert r["shadow"]["completion_tokens"] == 400 and r["primary"]["completion_tokens"] == 210
    assert r["similarity_mean"] == pytest.approx(0.625) and r["similarity_min"] == 0.25
    assert r["share_different"] == 0.5
    empty = report("none", [], 0)
    assert empty["count"] == 0 and empty["similarity_mean"] is None and empty["primary"]["latency_p50_ms"] is None


async def test_file_store_survives_a_new_instance_and_stays_bounded(tmp_path):
    store = FileShadowStore(tmp_path, max_records=5)
    for i in range(12):
        await store.add(ShadowRecord(ts=i, alias="chat/a b", primary=answer("m1", i), shadow=answer("m2", i),
                                     similarity=0.5))
    await store.add_drops("chat/a b", 3)
    await store.add_drops("chat/a b", 2)
    (tmp_path / "junk.jsonl").write_text("not json\n")
    records, drops = await FileShadowStore(tmp_path, max_records=5).read("chat/a b")
    assert [r.ts for r in records] == [7, 8, 9, 10, 11] and drops == 5
    assert len((tmp_path / next(p.name for p in tmp_path.glob("chat_a_b.*.jsonl"))).read_text().splitlines()) <= 10
    assert await FileShadowStore(tmp_path).read("other") == ([], 0)


def test_live_config_shadow_and_cascade_sections():
    cfg = MeshConfig.model_validate({
        "splits": {"assistant": {"targets": [{"model": "m1", "weight": 1}]}},
        "shadows": {"assistant": {"model": "m2", "sample": 0.5, "max_concurrency": 2}},
        "cascades": {"smart": {"cheap": "m1", "strong": "m2", "min_confidence": -1.5}}})
    assert cfg.shadows["assistant"].model == "m2" and cfg.cascades["smart"].min_confidence == -1.5
    bad = [
        {"shadows": {"a": {"model": "a"}}},
        {"shadows": {"a": {"model": "m", "sample": 0}}},
        {"shadows": {"a": {"model": "m", "max_concurrency": 0}}},
        {"shadows": {"a": {"model": "m", "unknown": 1}}},
        {"cascades": {"c": {"cheap": "m", "strong": "m", "min_confidence": -1}}},
        {"cascades": {"c": {"cheap": "m1", "strong": "m2", "min_confidence": 0.5}}},
        {"cascades": {"c": {"cheap": "c", "strong": "m2", "min_confidence": -1}}},
        {"cascades": {"c": {"cheap": "m1", "strong": "d", "min_confidence": -1},
                      "d": {"cheap": "m1", "strong": "m2", "min_confidence": -1}}},
        {"models": {"c": {}}, "cascades": {"c": {"cheap": "m1", "strong": "m2", "min_confidence": -1}}},
        {"splits": {"s": {"targets": [{"model": "m1", "weight": 1}]}},
         "cascades": {"c": {"cheap": "s", "strong": "m2", "min_confidence": -1}}},
    ]
    for doc in bad:
        with pytest.raises(ValidationError):
            MeshConfig.model_validate(doc)


def test_cascade_confidence_and_cost():
    assert mean_logprob([]) is None
    assert mean_logprob([-0.5, -1.5]) == -1.0
    price = Price(input_per_1k=1.0, output_per_1k=2.0)
    assert cost_usd(price, Usage(1000, 500)) == pytest.approx(2.0)
    assert cost_usd(None, Usage(1000, 500)) == 0.0


async def test_cli_report_reads_the_file_store(tmp_path, capsys):
    import json

    from llmesh.cli.main import build_parser

    store = FileShadowStore(tmp_path)
    for i in range(3):
        await store.add(ShadowRecord(ts=i, alias="assistant", primary=answer("m1", 10 + i),
                                     shadow=answer("m2", 20 + i, text="y"), similarity=0.5))
    await store.add_drops("assistant", 2)

    def cli(*argv: str) -> tuple[int, str, str]:
        args = build_parser().parse_args(["shadow", "report", *argv])
        code = await_free(args)
        out = capsys.readouterr()
        return code, out.out, out.err

    def await_free(args):  # the command runs its own event loop: run it off this one
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(args.func, args).result()

    code, out, _ = cli("assistant", "--dir", str(tmp_path), "--json")
    r = json.loads(out)
    assert code == 0 and (r["count"], r["dropped"], r["share_different"]) == (3, 2, 1.0)
    code, out, _ = cli("assistant", "--dir", str(tmp_path))
    assert code == 0 and "3 copies recorded" in out and "2 dropped" in out and "m2" in out
    code, out, _ = cli("nobody", "--dir", str(tmp_path))
    assert code == 0 and "no shadow records" in out
    code, _, err = cli("assistant", "--redis-url", "redis://127.0.0.1:1")
    assert code == 2 and "cannot read the shadow records" in err

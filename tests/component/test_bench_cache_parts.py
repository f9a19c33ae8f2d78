"""bench.cache's quick paths on tiny pair files (the real MiniLM): quality chosen on dev and
reported on held-out (adding held-out files changes no choice), the lookup latency through the
cache service over gRPC with a FAKE judge, and the FAQ stream through a sim-engine mesh.

``ScriptedJudge`` (from test_cache_verifier) is a FAKE judge: an aiohttp server speaking
OpenAI's chat completions, answering what the test scripts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from aiohttp import web

from bench.cache import bench_quality
from bench.cache_latency import lookups
from llmesh.liveconfig.schema import CacheVerifier
from tests.component.helpers import serving
from tests.component.test_cache_verifier import ScriptedJudge

DEV = [("hit", "paraphrase", "How do I reset my password?", "How can I reset my password?"),
       ("hit", "typo", "How do I change my email address?", "how do i chnage my email adress"),
       ("miss", "number", "How many days are in 3 weeks?", "How many days are in 5 weeks?"),
       ("miss", "topic", "How do I reset my password?", "How do I reset my router?"),
       ("miss", "negation", "How do I change my email address?", "Why can't I change my email address?"),
       # labelled a miss for the test: it passes every guard, so the verifier's judge decides it
       ("miss", "scope", "How do I change my email address?", "Could you tell me how I change my email address?")]
HELD = [("hit", "synonym", "How can I delete my account?", "How can I remove my account?"),
        ("miss", "scope", "How can I delete my account?", "How can I delete my team's account?"),
        ("hit", "reorder", "What time does the store open on Monday?", "On Monday, what time does the store open?")]
HELD_ZH = [("hit", "synonym", "如何删除我的账户？", "怎么删除我的账户？"),
           ("miss", "entity", "北京今天天气怎么样？", "上海今天天气怎么样？")]


def write(path: Path, rows) -> None:
    path.write_text("# label\tkind\ta\tb\n" + "".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture
def data(tmp_path):
    write(tmp_path / "cache_dev2_en.tsv", DEV)
    write(tmp_path / "cache_heldout_en.tsv", HELD)
    write(tmp_path / "cache_heldout_zh.tsv", HELD_ZH)
    return tmp_path


def test_quality_chooses_on_dev_and_reports_held_out(data, minilm, tmp_path_factory):
    out = bench_quality(minilm, 0.85, data)
    assert out["files"] == {"dev": ["cache_dev2_en.tsv"], "heldout": ["cache_heldout_en.tsv", "cache_heldout_zh.tsv"]}
    chosen = out["calibration"]
    assert chosen["threshold"] is not None and chosen["dev"]["false_hit_rate"] <= 0.01
    assert chosen["dev"]["pairs"] == len(DEV)  # held-out rows are not among the calibration's
    held = out["heldout_at_calibrated"]
    assert held["all"]["pairs"] == len(HELD) + len(HELD_ZH)
    assert set(held["by_lang"]) == {"en", "zh"} and set(held["by_kind"]) == {"synonym", "scope", "reorder", "entity"}
    assert out["heldout_at_default"]["threshold"] == 0.85
    assert set(out["goals"]) == {"recall_min", "false_hit_rate_max", "recall", "false_hit_rate", "met"}
    assert out["goals"]["recall"] == held["all"]["recall"]

    dev_only = tmp_path_factory.mktemp("dev_only")
    shutil.copy(data / "cache_dev2_en.tsv", dev_only)
    alone = bench_quality(minilm, 0.85, dev_only)
    assert alone["calibration"] == chosen  # the held-out files changed no choice
    assert alone["heldout_at_calibrated"] is None and alone["goals"]["met"] is False


async def test_lookup_latency_with_and_without_the_verifier(data, minilm_dir):
    fake = ScriptedJudge()
    fake.reply = '{"same": "no"}'
    web_app = web.Application()
    web_app.router.add_post("/v1/chat/completions", fake.handle)
    async with serving(web_app) as port:
        verifier = CacheVerifier(enabled=True, base_url=f"http://127.0.0.1:{port}/v1", model="judge",
                                 candidate_threshold=0.5, timeout_s=1.0)
        out = await lookups(minilm_dir, verifier, data, 10, None)
    assert out["stored"] == 3  # the dev pairs' distinct first questions
    off, on = out["miss_verifier_off"], out["miss_verifier_on"]
    assert off["n"] + on["n"] + sum(out["hits_not_timed"].values()) == 6  # the dev second questions, each once
    assert on["n"] >= 1 and off["n"] >= 1 and on["p99_ms"] >= on["p50_ms"] > 0
    assert out["judge"]["verdicts"]["no"] == len(fake.asked) >= 1  # the on-lookups were judged, said no
    judged = out["miss_verifier_on_judged"]
    assert 1 <= judged["n"] <= on["n"] and judged["p50_ms"] > 0
    assert out["added_p50_ms"] == round(on["p50_ms"] - off["p50_ms"], 3)
    assert out["added_p50_ms_judged"] == round(judged["p50_ms"] - off["p50_ms"], 3)
    goals = out["goals"]
    assert goals["added_p50_ms_max"] == 20.0
    assert goals["met"] == (goals["all_misses_met"] and goals["judged_misses_met"])
    assert goals["judged_misses_met"] == (out["added_p50_ms_judged"] <= 20.0)


def test_faq_stream_through_a_sim_mesh(data):
    from bench.cache_stream import bench_stream

    root = Path(__file__).resolve().parents[2]
    out = bench_stream(data, "sim", 12, 4, root / "var" / "models")
    assert out["pairs_from"] == "heldout" and out["files"] == ["cache_heldout_en.tsv", "cache_heldout_zh.tsv"]
    bases = len({a for _, _, a, _ in HELD + HELD_ZH})
    assert out["requests"] == bases + 12 and out["first_questions_hit"] == 0
    assert out["repeats"] >= 1 and out["exact_hits"] == out["repeats"]  # every repeat came from the cache
    assert out["hits"] == out["exact_hits"] + out["semantic_hits"] + out["false_hits"]
    saved = out["saved_from_gateway_metrics"]
    assert saved["tokens"]["exact"] > 0 and saved["usd"]["exact"] > 0  # read back from the gateway
    latency = out["miss_latency"]
    assert latency["ttft_cache_on"]["n"] + latency["ttft_cache_off"]["n"] + latency["hits_not_timed"] == 4
    assert latency["hits_not_timed"] == 0 and latency["added_p50_ms"] is not None  # fresh questions all miss

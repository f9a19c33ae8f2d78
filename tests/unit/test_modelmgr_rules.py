"""The model manager's pure rules: variant choice by memory budget over the
scheduler's placements, and the eval gate's scoring."""

from __future__ import annotations

import math

import pytest

from llmesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from llmesh.modelmgr.evaluation import GoldenCase, evaluate, similarity
from llmesh.modelmgr.placement import Target, place_variant
from llmesh.modelmgr.registry import Artifact

MIB = 2**20
VARIANTS = [Artifact("Q4_0", "gguf", "Q4_0", "a" * 64, 80 * MIB), Artifact("Q4_1", "gguf", "Q4_1", "b" * 64, 90 * MIB),
            Artifact("Q8_0", "gguf", "Q8_0", "c" * 64, 140 * MIB)]


def _planner(free_bytes: int, calls: list[int]):
    """A scheduler's answer over one engine with ``free_bytes`` free: placed, or
    refused for memory as the scheduler refuses."""
    async def place(memory_bytes: int) -> list[Target]:
        calls.append(memory_bytes)
        if memory_bytes > free_bytes:
            raise ResourceExhausted(f"{memory_bytes} > {free_bytes}", reason="insufficient_memory")
        return [Target("e1", "127.0.0.1:1")]
    return place


async def test_the_best_variant_fitting_85_percent_of_free_memory():
    # need = size x 1.25: Q8_0 175 MiB, Q4_1 112.5 MiB, Q4_0 100 MiB; asked over 0.85
    for free, best in ((300, "Q8_0"), (200, "Q4_1"), (125, "Q4_0")):
        chosen, targets = await place_variant(VARIANTS, _planner(free * MIB, []))
        assert chosen.variant == best and [t.endpoint_id for t in targets] == ["e1"]
    calls: list[int] = []
    with pytest.raises(ResourceExhausted, match="no variant fits 85%") as exc:
        await place_variant(VARIANTS, _planner(100 * MIB, calls))  # budget 85 MiB
    assert "Q8_0 (175 MiB)" in exc.value.message and "Q4_0 (100 MiB)" in exc.value.message
    assert calls == [math.ceil(n * MIB / 0.85) for n in (175, 112.5, 100)]  # largest first, each asked once
    chosen, _ = await place_variant(VARIANTS, _planner(100 * MIB, []), budget_fraction=1.0)
    assert chosen.variant == "Q4_0"


async def test_a_refusal_other_than_memory_ends_the_search():
    calls = []

    async def too_few_engines(memory_bytes: int) -> list[Target]:
        calls.append(memory_bytes)
        raise FailedPrecondition("2 replica(s) need 2 engines; 1 found")

    with pytest.raises(FailedPrecondition, match="1 found"):
        await place_variant(VARIANTS, too_few_engines)
    assert len(calls) == 1


async def test_eval_scores_exact_match_and_similarity():
    answers = {("new", "a"): "Paris is the capital.", ("old", "a"): "Paris is the capital.",
               ("new", "b"): "The sky is green today", ("old", "b"): "The sky is blue today"}

    async def generate(model, prompt):
        return answers[(model, prompt)]

    cases = [GoldenCase("a", "Paris"), GoldenCase("b", "blue")]
    result = await evaluate(cases, generate, "new", "old", threshold=0.8)
    assert result.exact_match == 0.5
    assert result.similarity == pytest.approx((1.0 + 0.8) / 2)  # 2 x 4 matching words / 10
    assert result.passed
    assert result.report["candidate_accuracy"] == 0.5 and result.report["baseline_accuracy"] == 1.0
    assert result.report["token_divergence"] is None and "logprobs" in result.report["token_divergence_note"]
    strict = await evaluate(cases, generate, "new", "old", threshold=0.95)
    assert not strict.passed and not strict.report["passed"]
    with pytest.raises(InvalidArgument):
        await evaluate(cases, generate, "new", "old", threshold=1.5)


def test_similarity_is_word_level():
    assert similarity("a b c d", "a b c d") == 1.0
    assert similarity("", "") == 1.0
    assert similarity("a b", "c d") == 0.0

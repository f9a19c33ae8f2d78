"""The model manager's pure rules: variant choice by memory budget, placement over
the scheduler's endpoint list, and the eval gate's scoring."""

from __future__ import annotations

import pytest

from llmesh.errors import FailedPrecondition, InvalidArgument, Unavailable
from llmesh.modelmgr.evaluation import GoldenCase, evaluate, similarity
from llmesh.modelmgr.placement import Engine, choose_variant, place
from llmesh.modelmgr.registry import Artifact

MIB = 2**20
VARIANTS = [Artifact("Q4_0", "gguf", "Q4_0", "a" * 64, 80 * MIB), Artifact("Q4_1", "gguf", "Q4_1", "b" * 64, 90 * MIB),
            Artifact("Q8_0", "gguf", "Q8_0", "c" * 64, 140 * MIB)]


def test_the_best_variant_fitting_85_percent_of_free_memory():
    # need = size x 1.25: Q8_0 175 MiB, Q4_1 112.5 MiB, Q4_0 100 MiB
    assert choose_variant(VARIANTS, 300 * MIB).variant == "Q8_0"      # budget 255
    assert choose_variant(VARIANTS, 200 * MIB).variant == "Q4_1"      # budget 170
    assert choose_variant(VARIANTS, 125 * MIB).variant == "Q4_0"      # budget 106.25
    with pytest.raises(FailedPrecondition, match="no variant fits"):
        choose_variant(VARIANTS, 100 * MIB)                           # budget 85
    assert choose_variant(VARIANTS, 100 * MIB, budget_fraction=1.0).variant == "Q4_0"


def _engine(eid, models=(), backend="llamacpp", load=0, healthy=True):
    return Engine(eid, f"127.0.0.1:{eid[-1]}", backend, tuple(models), healthy, load, 8 * 2**30)


def test_placement_spares_engines_an_alias_routes_to():
    engines = [_engine("e0", ["m@1"]), _engine("e1", ["other"], load=3), _engine("e2", [], load=5),
               _engine("e3", [], backend="sim"), _engine("e4", [], healthy=False)]
    # e0 carries m@1, which an alias routes to: never chosen; empty engines before busy ones
    assert [e.endpoint_id for e in place(engines, "gguf", 2, "m@2", busy={"m@1"})] == ["e2", "e1"]
    # an engine already serving the version comes first
    engines.append(_engine("e5", ["m@2"], load=9))
    assert [e.endpoint_id for e in place(engines, "gguf", 1, "m@2", busy={"m@1"})] == ["e5"]
    with pytest.raises(Unavailable, match="3 found"):
        place(engines, "gguf", 4, "m@3", busy={"m@1"})


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


def test_free_memory_is_gpu_memory_when_there_are_gpus():
    from llmesh.modelmgr.clients import free_memory
    from llmesh.v1 import scheduler_pb2

    cpu = scheduler_pb2.HardwareProfile(memory_total_bytes=16 * 2**30, memory_available_bytes=6 * 2**30)
    assert free_memory(cpu) == 6 * 2**30
    gpu = scheduler_pb2.HardwareProfile(memory_available_bytes=6 * 2**30, gpus=[
        scheduler_pb2.GpuInfo(memory_total_bytes=80 * 2**30, memory_used_bytes=20 * 2**30),
        scheduler_pb2.GpuInfo(memory_total_bytes=80 * 2**30, memory_used_bytes=70 * 2**30)])
    assert free_memory(gpu) == 70 * 2**30

"""The evaluation gate (seed 6.10.2): a golden set of prompts runs greedily through
the candidate and the version in service; their answers are compared.

- exact match: the share of prompts both answer identically;
- similarity: the mean word-level similarity of the two answers (difflib's ratio
  over word sequences, 0..1), so a reworded but close answer still counts;
- token-distribution divergence needs per-token logprobs, which the engines do not
  return yet: the report says so instead of inventing a number.

A candidate passes when its similarity reaches the threshold (and, if set, its exact
match reaches min_exact_match). Pure: the generation comes in through a callable."""

from __future__ import annotations

import difflib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmesh.errors import InvalidArgument

Generate = Callable[[str, str], Awaitable[str]]  # (served model, prompt) -> greedy answer


@dataclass(frozen=True, slots=True)
class GoldenCase:
    prompt: str
    expected: str = ""  # optional reference answer


@dataclass(frozen=True, slots=True)
class EvalResult:
    passed: bool
    exact_match: float
    similarity: float
    threshold: float
    report: dict[str, Any]


def load_golden(path: Path) -> list[GoldenCase]:
    """JSON lines: {"prompt": ..., "expected": ... (optional)}."""
    cases = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            cases.append(GoldenCase(str(item["prompt"]), str(item.get("expected", ""))))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"{path}:{i}: a golden case is {{\"prompt\": ...}} ({exc})",
                                  param="golden_set") from None
    if not cases:
        raise InvalidArgument(f"{path}: the golden set is empty", param="golden_set")
    return cases


def similarity(a: str, b: str) -> float:
    wa, wb = a.split(), b.split()
    if not wa and not wb:
        return 1.0
    return difflib.SequenceMatcher(None, wa, wb, autojunk=False).ratio()


def contains(answer: str, expected: str) -> bool:
    return expected.strip().lower() in answer.lower()


async def evaluate(cases: list[GoldenCase], generate: Generate, candidate: str, baseline: str,
                   threshold: float, min_exact_match: float = 0.0) -> EvalResult:
    if not 0.0 <= threshold <= 1.0 or not 0.0 <= min_exact_match <= 1.0:
        raise InvalidArgument("threshold and min_exact_match are between 0 and 1", param="threshold")
    rows = []
    for case in cases:
        cand, base = await generate(candidate, case.prompt), await generate(baseline, case.prompt)
        row = {"exact": cand == base, "similarity": round(similarity(cand, base), 4),
               "candidate_chars": len(cand), "baseline_chars": len(base)}
        if case.expected:
            row["candidate_correct"] = contains(cand, case.expected)
            row["baseline_correct"] = contains(base, case.expected)
        rows.append(row)
    exact = sum(r["exact"] for r in rows) / len(rows)
    sim = sum(r["similarity"] for r in rows) / len(rows)
    graded = [r for r in rows if "candidate_correct" in r]
    report = {"cases": rows, "candidate": candidate, "baseline": baseline, "n": len(rows),
              "exact_match": round(exact, 4), "similarity": round(sim, 4), "threshold": threshold,
              "min_exact_match": min_exact_match,
              "similarity_measure": "difflib word-sequence ratio",
              "token_divergence": None,
              "token_divergence_note": "not computed: the engines return no per-token logprobs yet"}
    if graded:
        report["candidate_accuracy"] = round(sum(r["candidate_correct"] for r in graded) / len(graded), 4)
        report["baseline_accuracy"] = round(sum(r["baseline_correct"] for r in graded) / len(graded), 4)
    passed = sim >= threshold and exact >= min_exact_match
    report["passed"] = passed
    return EvalResult(passed, exact, sim, threshold, report)

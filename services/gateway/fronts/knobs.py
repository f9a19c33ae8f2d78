"""The sampling knobs of an OpenAI request body beyond temperature and top_p: OpenAI's
penalties and the extras apps written for vLLM send. Types are checked here; the ranges
are SamplingParams' rules (common.proto), checked for both fronts by llmesh.validation;
an engine whose backend lacks one refuses it (400 naming it)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from llmesh.types import KNOBS


class SamplingKnobs(BaseModel):
    top_k: int | None = None               # vLLM's; -1 or 0: off
    min_p: float | None = None             # vLLM's; 0: off
    repetition_penalty: float | None = None  # vLLM's; 1: off
    presence_penalty: float | None = None  # OpenAI's; 0: off
    frequency_penalty: float | None = None  # OpenAI's; 0: off

    def knob_values(self) -> dict[str, Any]:
        """As Sampling's fields of the same names (int or float, or None)."""
        return self.model_dump(include=set(KNOBS))

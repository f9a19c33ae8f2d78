"""bench.engine's --calibrate: the sim profile it fits to the llama.cpp engine's token stamps and
cold-prompt TTFT, and that the sim loads it as the engine steps (prefill first)."""

from __future__ import annotations

from types import SimpleNamespace

from bench.engine import fit_profile
from llmesh.engine.backends.sim import SimProfile


def test_the_fitted_profile_reads_the_step_line_and_the_prefill_and_loads_in_the_sim(tmp_path):
    def stamps(step_ms: float) -> list[list[float]]:  # two requests, 5 tokens each, one step apart
        return [[i * step_ms / 1000 for i in range(5)] for _ in range(2)]

    by_level = {1: stamps(10.0), 2: stamps(12.0), 4: stamps(16.0)}  # 8 ms + 2 ms a sequence
    args = SimpleNamespace(slots=4, n_ctx=2048, max_tokens=32)
    profile = fit_profile(by_level, {"ttft_ms_p50": 1010.0, "prompt_tokens": 400}, args)
    assert (profile["decode_ms_base"], profile["decode_ms_per_seq"]) == (8.0, 2.0)
    assert profile["prefill_ms_per_token"] == 2.5  # (1010 - one step of 10 ms) / 400
    assert profile["prefill_first"] is True and profile["max_batch"] == 4
    path = tmp_path / "fitted.json"
    SimProfile(**{k: v for k, v in profile.items() if k != "fitted_from"}).save(path)
    assert SimProfile.load(path).prefill_first

"""bench.vllm's arithmetic: the engine's own TTFT read from a /metrics page (vLLM's histogram,
summed over its labels), and the per-level summary that sets the time a first token spends
outside the engine on one side against the other's, round by round (the engine's queueing and
prefill, which vary between rounds, drop out of it)."""

from bench.vllm import Side, engine_ttft, summarise

PAGE = """# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 3.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="lora"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="lora"} 0.25
vllm:time_per_output_token_seconds_sum{engine="0",model_name="m"} 9.0
"""


def test_the_engine_ttft_is_summed_over_every_label():
    assert engine_ttft(PAGE) == (1.75, 5)
    assert engine_ttft("") == (0.0, 0)


def _round(tps: float, p50: float, path: float) -> dict:
    return {"requests": 4, "errors": 0, "tokens_per_s": tps, "ttft_ms_p50": p50, "ttft_ms_p99": p50,
            "itl_ms_p50": 100.0, "first_gap_ms_p50": 100.0, "first_gap_ms_mean": 100.0,
            "cpu_ms_per_request": [1.0], "ttft_ms_mean": p50,
            "engine_ttft_ms_mean": p50 - path, "path_ttft_ms_mean": path}


def test_the_summary_sets_each_round_s_path_against_the_other_side_s():
    server, llmesh = Side("vllm_server", *[None] * 5), Side("llmesh", *[None] * 5)  # type: ignore[arg-type]
    server.rounds = {1: [_round(10, 400, 6.0), _round(10, 500, 7.0), _round(10, 450, 5.0)]}
    llmesh.rounds = {1: [_round(10, 520, 9.0), _round(10, 380, 8.0), _round(10, 460, 9.5)]}
    row = summarise(server, llmesh, [1])["1"]
    assert row["round_ttft_added_ms_p50"] == [120.0, -120.0, 10.0]  # the engine's noise
    assert row["round_ttft_path_added_ms"] == [3.0, 1.0, 4.5]
    assert row["ttft_path_added_ms"] == 3.0
    assert row["llmesh"]["path_ttft_ms_mean"] == 9.0 and row["vllm_server"]["path_ttft_ms_mean"] == 6.0
    assert row["server_ttft_p50_spread_ms"] == 100.0  # 400 to 500 ms: this level cannot resolve 5 ms
    server.rounds, llmesh.rounds = {1: server.rounds[1][:1]}, {1: llmesh.rounds[1][:1]}
    assert summarise(server, llmesh, [1])["1"]["server_ttft_p50_spread_ms"] is None  # one round: unknown


def test_each_guards_choice_is_a_valid_tenant_policy_over_the_defaults():
    from bench.vllm import GUARDS
    from llmesh.liveconfig.schema import Guards

    assert Guards(**GUARDS["shipped"]) == Guards()  # as shipped: prompts masked, answers not (issue 27)
    assert (Guards().pii, Guards().output_pii) == ("mask", "off")
    assert Guards(**GUARDS["answer"]).output_pii == "mask"
    off = Guards(**GUARDS["off"])
    assert (off.pii, off.output_pii, off.injection) == ("off", "off", "off")

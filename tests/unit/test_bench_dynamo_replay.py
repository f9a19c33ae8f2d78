"""bench.dynamo_replay: a generated workload as a Mooncake-style trace (everywhere), and Dynamo's
offline replay of the shared-prefix demo where ``make bench-tools`` built ``.venv-dynamo``."""

import json
import subprocess
import sys

import pytest

from bench.dynamo_replay import (DEMO_ENGINE, DYNAMO_PYTHON, ROOT, demo_requests, from_tokens, replay, saturation,
                                 second_half, summarize, to_trace)
from bench.saturation import highest
from bench.routing_sweep import keeps_up

HAVE_DYNAMO = DYNAMO_PYTHON.is_file()


def test_to_trace_numbers_shared_blocks_once_and_sorts_by_arrival():
    requests = [
        {"arrival_s": 0.5, "block_hashes": [0xAAAA, 0xBBBB], "input_tokens": 128, "output_tokens": 7},
        {"arrival_s": 0.25, "block_hashes": [0xAAAA, 0xCCCC], "input_tokens": 128, "output_tokens": 9},
        {"arrival_s": 1.0, "block_hashes": [0xDDDD], "input_tokens": 64, "output_tokens": 1},
    ]
    trace = to_trace(requests, block_size=64)
    assert [row["timestamp"] for row in trace] == [250.0, 500.0, 1000.0]
    assert [row["hash_ids"] for row in trace] == [[0, 2], [0, 1], [3]]  # ids in order of first appearance
    assert [(row["input_length"], row["output_length"]) for row in trace] == [(128, 9), (128, 7), (64, 1)]


def test_to_trace_reads_objects_and_gives_a_partial_last_block_its_own_id():
    class Request:
        def __init__(self, at: float, hashes: list[str], tokens: int):
            self.arrival_s, self.block_hashes, self.input_tokens, self.output_tokens = at, hashes, tokens, 4

    # 150 tokens in blocks of 64: two full blocks hashed (as chain_hashes gives them), one partial
    trace = to_trace([Request(0.0, ["p", "q"], 150), Request(0.1, ["p", "q"], 150)], block_size=64)
    assert trace[0]["hash_ids"][:2] == trace[1]["hash_ids"][:2] == [0, 1]
    assert trace[0]["hash_ids"][2] != trace[1]["hash_ids"][2]  # the partial blocks are not shared
    assert len({*trace[0]["hash_ids"], *trace[1]["hash_ids"]}) == 4


def test_prompts_as_token_ids_share_the_ids_of_their_common_whole_blocks():
    system = list(range(1000, 1000 + 130))  # two whole blocks of 64 and 2 tokens more
    first = from_tokens(0.0, system + [1, 2, 3], 16)
    second = from_tokens(0.2, system + [7, 8, 9, 10], 16)
    trace = to_trace([first, second], block_size=64)
    assert [row["input_length"] for row in trace] == [133, 134]
    assert trace[0]["hash_ids"][:2] == trace[1]["hash_ids"][:2]  # the system prompt's whole blocks
    assert trace[0]["hash_ids"][2] != trace[1]["hash_ids"][2]    # the third block differs
    assert len(trace[0]["hash_ids"]) == len(trace[1]["hash_ids"]) == 3


@pytest.mark.parametrize(("hashes", "tokens"), [([1], 192), ([1, 2, 3], 128), ([], 0)])
def test_to_trace_refuses_a_block_count_that_does_not_fit_the_tokens(hashes, tokens):
    with pytest.raises(ValueError):
        to_trace([{"arrival_s": 0.0, "block_hashes": hashes, "input_tokens": tokens, "output_tokens": 1}], 64)


def test_the_demo_is_groups_over_long_shared_prefixes_with_poisson_arrivals():
    trace = to_trace(demo_requests(n=400, rate=40.0, groups=8, prefix_blocks=32, own_blocks=2))
    prefixes = {tuple(row["hash_ids"][:32]) for row in trace}
    assert len(prefixes) == 8
    owns = [row["hash_ids"][32:] for row in trace]
    assert len({h for own in owns for h in own}) == 2 * 400  # every request's own blocks are its own
    gaps = [b["timestamp"] - a["timestamp"] for a, b in zip(trace, trace[1:])]
    assert all(g >= 0 for g in gaps) and 15 < sum(gaps) / len(gaps) < 35  # mean 25 ms at 40/s


def test_summarize_takes_the_ratios_round_robin_over_kv_router():
    fields = {"median_ttft_ms": 10.0, "p99_ttft_ms": 40.0, "mean_ttft_ms": 20.0, "prefix_cache_reused_ratio": 0.9}
    out = summarize({"kv_router": fields, "round_robin": {**fields, "median_ttft_ms": 25.0, "p99_ttft_ms": 400.0}})
    assert out["round_robin"]["ttft_p50_ms"] == 25.0 and out["kv_router"]["prefix_reuse"] == 0.9
    assert out["ratios"] == {"ttft_p50_ms_rr_over_kv": 2.5, "ttft_p99_ms_rr_over_kv": 10.0,
                             "ttft_mean_ms_rr_over_kv": 1.0}


def test_summarize_gives_no_ratio_for_one_mode_and_keeps_its_window():
    fields = {"median_ttft_ms": 10.0, "window": {"came": 5, "done": 4}}
    out = summarize({"round_robin": fields})
    assert out == {"round_robin": {"ttft_p50_ms": 10.0, "window": {"came": 5, "done": 4}}}


def test_second_half_counts_arrivals_and_finishes_in_the_arrival_window_s_second_half():
    requests = [{"arrival_time_ms": a, "terminal_time_ms": t}
                for a, t in [(0, 40), (30, 60), (50, 70), (60, 130), (80, 99), (100, 500), (90, None)]]
    # the window is [50, 100): 50, 60, 80, 90 arrived there; 60, 70, 99 finished there
    assert second_half(requests) == {"came": 4, "done": 3}
    assert second_half([]) == {"came": 0, "done": 0}


@pytest.mark.parametrize("start", [0.1, 1.0, 40.0])
def test_highest_brackets_then_bisects_to_the_last_value_that_passes(start):
    seen = []

    def probe(x):
        seen.append(x)
        return x <= 3.7, {"at": x}

    value, measured, probes = highest(probe, start, bisect=6)
    assert value <= 3.7 and measured == {"at": value} and probes == len(seen)
    failed = min(x for x in seen if x > 3.7)
    assert failed - value <= 3.7 * 0.5 / 2 ** 6 + 1e-9  # a bracket of at most half the edge, halved 6 times


def test_highest_refuses_when_nothing_passes_or_nothing_fails():
    with pytest.raises(RuntimeError):
        highest(lambda x: (False, None), 1.0, bisect=2, floor=0.01)
    with pytest.raises(RuntimeError):
        highest(lambda x: (True, None), 1.0, bisect=2, limit=10)


def test_replay_without_the_dynamo_venv_says_it_was_skipped(tmp_path):
    trace = to_trace(demo_requests(n=4))
    assert replay(trace, python=tmp_path / "no-such-python") == {"skipped": "make bench-tools not run"}
    assert saturation(trace, keeps_up, python=tmp_path / "no-such-python") == {"skipped": "make bench-tools not run"}


@pytest.mark.skipif(not HAVE_DYNAMO, reason=".venv-dynamo missing: make bench-tools (or make dynamo-tools) not run")
def test_replay_refuses_an_empty_trace():
    with pytest.raises(ValueError):
        replay([])


@pytest.mark.skipif(not HAVE_DYNAMO, reason=".venv-dynamo missing: make bench-tools (or make dynamo-tools) not run")
def test_dynamo_kv_router_beats_round_robin_on_the_shared_prefix_demo():
    trace = to_trace(demo_requests(n=600))
    out = replay(trace, workers=4, engine=DEMO_ENGINE)
    for mode in ("kv_router", "round_robin"):
        assert out[mode]["completed"] == 600
    assert out["kv_router"]["prefix_reuse"] > out["round_robin"]["prefix_reuse"]
    assert out["ratios"]["ttft_p50_ms_rr_over_kv"] > 1.2
    assert out["ratios"]["ttft_p99_ms_rr_over_kv"] > 2.0
    assert out["ratios"]["ttft_mean_ms_rr_over_kv"] > 1.5


@pytest.mark.skipif(not HAVE_DYNAMO, reason=".venv-dynamo missing: make bench-tools (or make dynamo-tools) not run")
def test_the_cli_replays_a_trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in to_trace(demo_requests(n=120))))
    done = subprocess.run([sys.executable, "-m", "bench.dynamo_replay", "--trace", str(path), "--json",
                           "--num-gpu-blocks", "800"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["requests"] == 120 and out["engine"] == {"num_gpu_blocks": 800}
    assert out["kv_router"]["completed"] == out["round_robin"]["completed"] == 120
    assert out["kv_router"]["ttft_p50_ms"] > 0 and out["wall_s"] > 0


@pytest.mark.skipif(not HAVE_DYNAMO, reason=".venv-dynamo missing: make bench-tools (or make dynamo-tools) not run")
def test_dynamo_s_saturation_is_the_rate_its_workers_stop_keeping_up_with():
    """The sim's rule on Dynamo's mock: the trace sped up to the found speedup keeps up, and at
    twice that a backlog grows (fewer finish in the second half than arrive)."""
    trace = to_trace(demo_requests(n=400, rate=10.0))
    found = saturation(trace, keeps_up, engine=DEMO_ENGINE, bisect=3)
    assert found["mode"] == "round_robin" and found["speedup"] > 0 and keeps_up(**found["window"])
    below = replay(trace, modes=("round_robin",), speedup=found["speedup"] / 2, engine=DEMO_ENGINE)
    above = replay(trace, modes=("round_robin",), speedup=found["speedup"] * 2, engine=DEMO_ENGINE)
    assert "kv_router" not in below and "ratios" not in below and below["speedup"] == found["speedup"] / 2
    assert keeps_up(**below["round_robin"]["window"]) and not keeps_up(**above["round_robin"]["window"])
    assert above["round_robin"]["ttft_p50_ms"] > below["round_robin"]["ttft_p50_ms"]

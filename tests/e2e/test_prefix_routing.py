"""KV-aware picking through the whole mesh (`llmesh up`): a conversation's follow-up
turn lands on the engine that holds its prefix and its time to first token falls,
on 2 sim engines with a real prefill cost and on 2 llama.cpp engines with the real
model (the gateway hashing prompts with the GGUF's own tokenizer and chat template);
the routing policy then switches to round_robin by editing the live config file,
without a restart."""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmesh.testing import Mesh, free_layout, wait_until
from tests.e2e.conftest import endpoints, openai_client

MODEL = "sim-small"
PREFILL_MS_PER_TOKEN = 3.0


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "llmesh.yaml"
    path.write_text(f"models: {{{MODEL}: {{routing: prefix_aware}}}}\n")
    return path


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, real_model_dir, config_file):
    m = Mesh(layout=free_layout(n_engines=2), engines="sim:2", model_dir=real_model_dir,
             log_dir=tmp_path_factory.mktemp("prefix"),
             env={"LLMESH_ENGINE_SIM_PREFILL_MS_PER_TOKEN": str(PREFILL_MS_PER_TOKEN),
                  "LLMESH_ENGINE_SIM_DECODE_MS_PER_TOKEN": "2", "LLMESH_ENGINE_SIM_OUTPUT_TOKENS": "4",
                  "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600", "LLMESH_CONFIG_FILE": str(config_file)},
             args=["--no-cache"])
    m.start(timeout_s=120)
    assert wait_until(lambda: sum(e.healthy for e in endpoints(m)) == 2, 30)
    yield m
    assert m.stop() == 0, m.logs()


def served_by(mesh, request_id: str) -> str:
    """The engine the gateway's access log names for a request."""
    found: list[str] = []

    def look() -> bool:
        for line in (mesh.log_dir / "gateway.log").read_text().splitlines():
            if request_id in line and '"msg":"request"' in line:
                found.append(json.loads(line)["endpoint"])
                return True
        return False

    assert wait_until(look, 5), request_id
    return found[0]


def turn(client, mesh, messages, model: str = MODEL) -> tuple[str, float, str]:
    """(engine that served, TTFT in s, answer)."""
    rid = uuid.uuid4().hex
    started = time.perf_counter()
    ttft, parts = None, []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=4, stream=True,
                                                extra_headers={"x-request-id": rid}):
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - started
            parts.append(chunk.choices[0].delta.content)
    return served_by(mesh, rid), ttft, "".join(parts)


def test_follow_up_turn_lands_on_the_engine_holding_its_prefix(mesh):
    client = openai_client(mesh)
    results = []
    with ThreadPoolExecutor(2) as pool:
        for pair in range(3):
            # two conversations at once: the gateway's in-flight count sends them to different engines
            convs = [[{"role": "system", "content": " ".join(f"p{pair}c{c}w{k}" for k in range(150))},
                      {"role": "user", "content": "first question"}] for c in range(2)]
            firsts = list(pool.map(lambda m: turn(client, mesh, m), convs))
            assert firsts[0][0] != firsts[1][0], firsts
            # the engines' block events reach the gateway (engine -> scheduler -> gateway) within a report or two
            time.sleep(1.5)
            for messages, (first, ttft1, answer) in zip(convs, firsts):
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "a follow-up"}]
                second, ttft2, _ = turn(client, mesh, messages)
                results.append((first, second, ttft1, ttft2))
    print("turns (engine 1, engine 2, ttft 1 s, ttft 2 s):",
          [(a, b, round(x, 3), round(y, 3)) for a, b, x, y in results])
    assert all(first == second for first, second, _, _ in results), results
    for _, _, ttft1, ttft2 in results:
        assert ttft1 > 150 * PREFILL_MS_PER_TOKEN / 1000 * 0.8
        assert ttft2 < ttft1 / 3, results


def test_routing_policy_switches_live_to_round_robin(mesh, config_file):
    client = openai_client(mesh)
    messages = [{"role": "user", "content": "same question every time " * 20}]
    home = turn(client, mesh, messages)[0]
    time.sleep(1.5)
    assert [turn(client, mesh, messages)[0] for _ in range(4)] == [home] * 4   # prefix_aware: it sticks
    config_file.write_text(f"models: {{{MODEL}: {{routing: round_robin}}}}\n")

    def alternates() -> bool:
        order = [turn(client, mesh, messages)[0] for _ in range(6)]
        return all(a != b for a, b in zip(order, order[1:]))

    # prefix_aware would keep every copy of this prompt on one engine; round robin alternates
    assert wait_until(alternates, 20, interval_s=0.5)


SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def llama_mesh(tmp_path_factory, real_model_dir):
    config = tmp_path_factory.mktemp("llama-config") / "llmesh.yaml"
    config.write_text(f"models: {{{SMOL}: {{routing: prefix_aware}}}}\n")
    m = Mesh(layout=free_layout(n_engines=2), engines="llamacpp:2", model_dir=real_model_dir,
             log_dir=tmp_path_factory.mktemp("prefix-llama"),
             env={"LLMESH_ENGINE_N_CTX": "1024", "LLMESH_ENGINE_MAX_RUNNING": "2", "LLMESH_ENGINE_N_THREADS": "1",
                  "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600", "LLMESH_CONFIG_FILE": str(config)},
             args=["--no-cache"])
    m.start(timeout_s=240)
    assert wait_until(lambda: sum(e.healthy for e in endpoints(m)) == 2, 60)
    yield m
    assert m.stop() == 0, m.logs()


def test_follow_up_turn_lands_on_the_llamacpp_engine_holding_its_prefix(llama_mesh):
    client = openai_client(llama_mesh, timeout=60)
    results = []
    with ThreadPoolExecutor(2) as pool:
        for pair in range(2):
            convs = [[{"role": "system", "content": f"Conversation {pair}-{c}. " + " ".join(
                f"Fact {k}: item {pair * 100 + c * 50 + k} is stored in bin {k * 7 % 13}." for k in range(30))},
                      {"role": "user", "content": "Which bin holds item 3?"}] for c in range(2)]
            firsts = list(pool.map(lambda m: turn(client, llama_mesh, m, SMOL), convs))
            assert firsts[0][0] != firsts[1][0], firsts
            time.sleep(1.5)
            for messages, (first, ttft1, answer) in zip(convs, firsts):
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And item 4?"}]
                second, ttft2, _ = turn(client, llama_mesh, messages, SMOL)
                results.append((first, second, ttft1, ttft2))
    print("llama.cpp turns (engine 1, engine 2, ttft 1 s, ttft 2 s):",
          [(a, b, round(x, 3), round(y, 3)) for a, b, x, y in results])
    assert all(first == second for first, second, _, _ in results), results
    assert all(ttft2 < ttft1 / 2 for _, _, ttft1, ttft2 in results), results

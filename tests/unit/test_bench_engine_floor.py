"""bench.engine_floor measures what sits under the engine wrapper: the sim backend alone
producing answers of the asked length (no gRPC), and a bare grpc.aio servicer answering
with as many messages as asked; a short run reports every figure."""

import asyncio

from bench import engine_floor
from bench.gateway import MODEL, PROMPT


def test_the_sim_alone_takes_every_step_of_the_answer():
    r = engine_floor.sim_alone(MODEL, PROMPT, tokens=8, temperature=0.7, requests=5, warmup=1)
    assert r["requests"] == 5 and r["steps_per_answer_mean"] == 8  # nothing waits on it: a step a list
    assert r["cpu_ms_per_request"] > 0


def test_the_bare_servicer_answers_with_the_asked_messages():
    r = asyncio.run(engine_floor.grpc_floor(messages=4, requests=5))
    assert r["messages"] == 4 and r["messages_seen_mean"] == 4
    assert r["cpu_ms_one_message"] >= 0 and r["cpu_ms_per_request"] >= 0
    assert set(r) == {"messages", "messages_seen_mean", "cpu_ms_one_message", "cpu_ms_per_request",
                      "cpu_ms_per_added_message"}

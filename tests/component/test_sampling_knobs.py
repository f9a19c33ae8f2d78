"""The sampling knobs (top_k, min_p, repetition_penalty, presence_penalty,
frequency_penalty) in the engine: their effect on the real llama.cpp backend (SmolLM2)
through the engine core, and the sim's refusal naming the knob it lacks."""

from __future__ import annotations

import pytest

from llmesh.errors import InvalidArgument
from llmesh.types import Prompt, Sampling
from llmesh.engine.backends.llamacpp import LlamaCppBackend
from llmesh.engine.backends.sim import SimBackend, SimProfile
from tests.component.test_logprobs_and_grammars import MODEL, ask, core_for, run

REPEAT = ask("Write the word cat twenty times, separated by spaces.")
COUNTING = Prompt(text="1, 2, 3, 1, 2, 3, 1, 2, 3,")
CATS = Prompt(text="cat cat cat cat cat cat cat cat")


@pytest.fixture(scope="module")
async def llama(real_model_dir):
    b = LlamaCppBackend.from_store(real_model_dir, MODEL, n_ctx=1024, n_threads=2, n_batch=256, n_slots=4)
    yield b
    await b.close()


async def greedy(core, prompt: Prompt, **knobs) -> str:
    return (await run(core, MODEL, prompt, Sampling(max_tokens=24, temperature=0.0, **knobs)))[0]


async def test_top_k_1_and_min_p_1_are_greedy_whatever_the_seed(llama):
    core = core_for(llama)
    prompt = ask("Tell me a short story about a fox.")
    best = await greedy(core, prompt)
    hot = [(await run(core, MODEL, prompt, Sampling(max_tokens=24, temperature=1.5, seed=seed)))[0]
           for seed in (1, 2, 3)]
    assert len(set(hot)) > 1 and best not in hot  # without a knob, a hot draw wanders off
    for seed in (1, 2, 3):
        for knob in ({"top_k": 1}, {"min_p": 1.0}):
            text, _, _ = await run(core, MODEL, prompt, Sampling(max_tokens=24, temperature=1.5, seed=seed, **knob))
            assert text == best, (knob, seed)


async def test_off_values_change_nothing(llama):
    core = core_for(llama)
    assert await greedy(core, REPEAT, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                        frequency_penalty=0.0) == await greedy(core, REPEAT, top_k=-1) == await greedy(core, REPEAT)


async def test_penalties_stop_the_repetition(llama):
    core = core_for(llama)
    plain = await greedy(core, COUNTING)
    assert plain.count("1, 2, 3") >= 2  # greedy, the small model keeps the pattern going
    # repetition_penalty counts the prompt's tokens too: the pattern is penalised from the first token;
    # frequency_penalty grows with each repeat in the answer
    for knobs in ({"repetition_penalty": 10.0}, {"frequency_penalty": 2.0}):
        text = await greedy(core, COUNTING, **knobs)
        assert text != plain and text.count("1, 2, 3") < plain.count("1, 2, 3"), (knobs, text)
    # presence_penalty: once a token is in the answer, the same penalty however often (the newline here)
    assert await greedy(core, CATS, presence_penalty=2.0) != await greedy(core, CATS)


async def test_a_mild_repetition_penalty_with_sampling_is_seeded_like_any_draw(llama):
    core = core_for(llama)
    s = Sampling(max_tokens=16, temperature=0.8, seed=7, top_k=40, min_p=0.05, repetition_penalty=1.2)
    first, _, finish = await run(core, MODEL, REPEAT, s)
    assert first and finish.usage.completion_tokens >= 1
    assert (await run(core, MODEL, REPEAT, s))[0] == first


@pytest.mark.parametrize("knob,value", [("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.1),
                                        ("presence_penalty", 0.5), ("frequency_penalty", -0.5)])
async def test_sim_refuses_a_knob_it_lacks_by_name_and_takes_off_values(knob, value):
    sim = SimBackend("sim-knobs", 512, SimProfile(decode_ms_base=1.0, output_tokens=3))
    try:
        core = core_for(sim)
        with pytest.raises(InvalidArgument) as info:
            await run(core, "sim-knobs", Prompt(text="a"), Sampling(max_tokens=3, **{knob: value}))
        assert info.value.param == knob and knob in info.value.message
        off = Sampling(max_tokens=3, top_k=-1, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                       frequency_penalty=0.0)
        assert (await run(core, "sim-knobs", Prompt(text="a"), off))[2].usage.completion_tokens == 3
    finally:
        await sim.close()

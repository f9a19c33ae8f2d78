"""The engine sends every token that is ready at once in one Delta (one gRPC message):
a decode step's, or the backlog of a consumer that fell behind; text, token counts,
logprobs and stop strings come out as they would one token at a time."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from llmesh.types import Delta, Finish, Prompt, Sampling
from llmesh.engine.admission import Admission
from llmesh.engine.backends.base import Capabilities, DecodeParams, steps_of
from llmesh.engine.backends.sim import SimBackend, SimProfile
from llmesh.engine.core import EngineCore, LastDelta


def sim() -> SimBackend:
    return SimBackend("sim-t", 4096, SimProfile(decode_ms_base=0.0, output_tokens=64))


async def collect(core: EngineCore, sampling: Sampling, slow: bool) -> tuple[list[Delta], Finish]:
    deltas, finish = [], None
    async with aclosing(core.generate("sim-t", Prompt(text="tell me"), sampling)) as items:
        async for item in items:
            if isinstance(item, Delta):
                deltas.append(item)
                if slow:  # a consumer busy elsewhere: the steps run ahead of it
                    for _ in range(5):
                        await asyncio.sleep(0)
            else:
                finish = item
    return deltas, finish


async def test_a_backlog_goes_out_as_one_delta_with_the_same_text_and_counts():
    backend = sim()
    core = EngineCore(backend, Admission(4, 4))
    sampling = Sampling(max_tokens=24, temperature=0.7, seed=3)
    fast, fast_finish = await collect(core, sampling, slow=False)
    slow, slow_finish = await collect(core, sampling, slow=True)
    assert "".join(d.text for d in slow) == "".join(d.text for d in fast)
    assert (sum(d.tokens for d in slow) == slow_finish.usage.completion_tokens == 24
            == fast_finish.usage.completion_tokens)
    assert len(slow) < 24 and max(d.tokens for d in slow) > 1  # several tokens a message
    with_lp, _ = await collect(core, Sampling(max_tokens=24, temperature=0.7, seed=3, logprobs=2), slow=True)
    assert all(len(d.logprobs) == d.tokens for d in with_lp) and sum(d.tokens for d in with_lp) == 24
    assert "".join(t.token for d in with_lp for t in d.logprobs) == "".join(d.text for d in fast)
    await backend.close()


async def test_a_stop_string_inside_a_backlog_ends_the_answer_there():
    backend = sim()
    core = EngineCore(backend, Admission(4, 4))
    fast, _ = await collect(core, Sampling(max_tokens=24, temperature=0.7, seed=5), slow=False)
    text = "".join(d.text for d in fast)
    stop = text.split(" ")[4]  # the fifth word
    cut, finish = await collect(core, Sampling(max_tokens=24, temperature=0.7, seed=5, stop=(" " + stop,)), slow=True)
    before = text[:text.index(" " + stop)]
    assert "".join(d.text for d in cut) == before
    # the words before it and the stop word itself were generated
    assert finish.reason.value == "stop" and finish.usage.completion_tokens == before.count(" ") + 2
    await backend.close()


async def test_a_backend_without_steps_is_taken_one_piece_a_step():
    class OneByOne:
        capabilities = Capabilities()  # no stream_steps declared

        def __init__(self, inner):
            self.inner = inner

        def stream(self, tokens, params):
            return self.inner.stream(tokens, params)

    backend = sim()
    steps = [s async for s in steps_of(OneByOne(backend), backend.tokenize(Prompt(text="x")),
                                       DecodeParams(6, 0.0, 1.0, 0))]
    assert len(steps) == 6 and all(len(s) == 1 for s in steps)
    await backend.close()


async def test_the_last_delta_is_marked_when_only_the_finish_can_follow():
    """max_tokens or a stop string ends the answer: its last Delta is a LastDelta (the engine
    sends it with the Finish); an answer the backend ends itself ends with a plain Delta."""
    backend = SimBackend("sim-t", 4096, SimProfile(decode_ms_base=0.0, output_tokens=10))
    core = EngineCore(backend, Admission(4, 4))
    for sampling in (Sampling(max_tokens=6, temperature=0.7, seed=3),
                     Sampling(max_tokens=6, temperature=0.7, seed=3, logprobs=1)):
        for slow in (False, True):
            deltas, finish = await collect(core, sampling, slow=slow)
            assert type(deltas[-1]) is LastDelta and not any(type(d) is LastDelta for d in deltas[:-1])
            assert finish.reason.value == "length" and sum(d.tokens for d in deltas) == 6
    text = "".join(d.text for d in (await collect(core, Sampling(max_tokens=6, temperature=0.7, seed=3), False))[0])
    stopped, finish = await collect(core, Sampling(max_tokens=6, temperature=0.7, seed=3,
                                                   stop=(" " + text.split(" ")[3],)), slow=False)
    assert finish.reason.value == "stop" and type(stopped[-1]) is LastDelta
    ended, finish = await collect(core, Sampling(max_tokens=20, temperature=0.7, seed=3), slow=False)
    assert finish.usage.completion_tokens == 10 and type(ended[-1]) is Delta  # the sim's answer length
    await backend.close()

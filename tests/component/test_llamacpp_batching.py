"""The llama.cpp backend really batches: concurrent sequences share decode steps,
and a prompt prefix cached in a slot is not computed again."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import pytest

from llmesh.types import Message, Prompt
from llmesh.engine.backends.base import DecodeParams
from llmesh.engine.backends.llamacpp import LlamaCppBackend

SYSTEM = "You are the help desk of a harbour office. Answer in one short sentence. " * 12


@pytest.fixture
async def backend(real_model_dir):
    b = LlamaCppBackend.from_store(real_model_dir, "smollm2-135m-instruct", n_ctx=1024, n_threads=2,
                                   n_batch=256, n_slots=4)
    yield b
    await b.close()


async def run(backend, tokens, n: int, temperature: float = 0.0, seed: int = 0) -> tuple[float, list[str]]:
    started = time.perf_counter()
    first = None
    pieces = []
    async with aclosing(backend.stream(tokens, DecodeParams(n, temperature, 1.0, seed))) as stream:
        async for piece in stream:
            first = first or time.perf_counter() - started
            pieces.append(piece)
    return first, pieces


async def test_concurrent_sequences_share_decode_steps(backend):
    prompts = [backend.tokenize(Prompt(messages=(Message("user", f"Tell me a story about ship {i}."),)))
               for i in range(4)]
    steps = backend._runner.steps
    results = await asyncio.gather(*(run(backend, p, 24) for p in prompts))
    tokens = sum(len(pieces) for _, pieces in results)
    used = backend._runner.steps - steps
    assert tokens >= 40
    assert used < tokens * 0.6, f"{tokens} tokens took {used} decode steps: not batched"


async def test_per_request_sampling_in_one_batch(backend):
    prompt = backend.tokenize(Prompt(messages=(Message("user", "Name a colour."),)))
    alone = (await run(backend, prompt, 12))[1]
    together = await asyncio.gather(run(backend, prompt, 12), run(backend, prompt, 12, temperature=1.5, seed=7),
                                    run(backend, prompt, 12, temperature=1.5, seed=7))
    assert together[0][1] == alone  # greedy is unaffected by its batch-mates
    assert together[1][1] == together[2][1]  # same seed, same draw


async def test_a_cached_prefix_is_not_computed_again(backend):
    def ask(q: str) -> list[int]:
        return backend.tokenize(Prompt(messages=(Message("system", SYSTEM), Message("user", q))))

    # Work done is measured as this process's CPU time: wall time swings with the machine's load.
    cold_tokens = ask("Where is pier four?")
    queries, hits = backend.prefix_cache_stats()
    started = time.process_time()
    await run(backend, cold_tokens, 2)
    cold = time.process_time() - started
    warm_tokens = ask("When does the office open?")
    started = time.process_time()
    await run(backend, warm_tokens, 2)
    warm = time.process_time() - started
    queries2, hits2 = backend.prefix_cache_stats()
    shared = next(i for i, (a, b) in enumerate(zip(cold_tokens, warm_tokens)) if a != b)
    assert shared > 150
    assert hits2 - hits >= shared  # the second prompt's shared part came from the cache
    assert queries2 - queries == len(cold_tokens) + len(warm_tokens)
    assert warm < cold / 3, (cold, warm)


async def test_a_burst_with_one_system_prompt_computes_it_once(backend):
    """Four identical requests at once: the first computes the prompt, the others copy
    its cells once they exist, and greedy decoding gives all four the same answer."""
    prompt = backend.tokenize(Prompt(messages=(Message("system", "Fresh rules. " + SYSTEM),
                                               Message("user", "Is pier four open?"))))
    copies, (_, hits) = backend._runner.prefix_copies, backend.prefix_cache_stats()
    burst = await asyncio.gather(*(run(backend, prompt, 8) for _ in range(4)))
    assert backend._runner.prefix_copies - copies == 3
    assert backend.prefix_cache_stats()[1] - hits == 3 * (len(prompt) - 1)
    assert burst[0][1] and all(pieces == burst[0][1] for _, pieces in burst)


async def test_a_consumer_that_fell_behind_gets_the_backlog_in_one_step(backend):
    """``stream_steps`` hands over every piece that is ready at once: the engine sends
    them as one message. The pieces are the ones ``stream`` yields, in order."""
    tokens = backend.tokenize(Prompt(messages=(Message("user", "Name the planets of the solar system."),)))
    _, expected = await run(backend, tokens, 16)
    steps = []
    async with aclosing(backend.stream_steps(tokens, DecodeParams(16, 0.0, 1.0, 0))) as stream:
        async for pieces in stream:
            steps.append(pieces)
            await asyncio.sleep(0.15)  # busy elsewhere while the runner decodes on
    assert [p for pieces in steps for p in pieces] == expected
    assert len(steps) < len(expected) and max(len(pieces) for pieces in steps) > 1


async def test_a_newcomer_s_first_token_goes_out_before_its_neighbours_next_ones(backend):
    """A step that holds a prompt and decoding sequences decodes the prompt first, in a call of its
    own, and hands its first token out before the decoding sequences' tokens of that step (on a CPU a
    batch costs the sum of its parts, so theirs come no later than in one mixed batch)."""
    runner = backend._runner
    handed: list[tuple[int, list]] = []  # (decode calls so far, the sequences of one hand-over)
    deliver = runner._deliver

    def recording(out: list) -> None:
        handed.append((runner.steps, [seq for seq, pieces, _, _ in out if pieces]))
        deliver(out)

    runner._deliver = recording
    started = asyncio.Event()

    async def neighbour(i: int) -> None:
        prompt = backend.tokenize(Prompt(messages=(Message("user", f"Tell me a long story about ship {i}."),)))
        async with aclosing(backend.stream(prompt, DecodeParams(200, 0.0, 1.0, i))) as stream:
            async for _ in stream:
                started.set()

    neighbours = [asyncio.create_task(neighbour(i)) for i in range(2)]
    await started.wait()
    await asyncio.sleep(0.2)  # both decode
    newcomer = backend.tokenize(Prompt(messages=(Message("system", SYSTEM), Message("user", "Where is pier 4?"))))
    await run(backend, newcomer, 1)
    for task in neighbours:
        task.cancel()
    await asyncio.gather(*neighbours, return_exceptions=True)
    at = next(i for i, (_, seqs) in enumerate(handed) if any(s.prompt == newcomer for s in seqs))
    steps, seqs = handed[at]
    assert all(s.prompt == newcomer for s in seqs)  # its first token alone: the neighbours' came next
    after_steps, after = handed[at + 1]
    assert after_steps == steps + 1 and after and not any(s.prompt == newcomer for s in after)

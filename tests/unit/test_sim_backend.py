"""The sim behaves like a batching engine: step time grows with the batch, cached
prefixes skip prefill, a full KV cache makes requests wait (highest priority class
first), profiles round-trip."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

from llmesh.types import Message, Priority, Prompt
from llmesh.engine.backends.base import DecodeParams
from llmesh.engine.backends.sim import SimBackend, SimProfile


async def timed(backend: SimBackend, text: str, n: int) -> tuple[float, float]:
    """(TTFT, total) in seconds."""
    started = time.perf_counter()
    first = None
    async with aclosing(backend.stream(backend.tokenize(Prompt(text=text)), DecodeParams(n, 0.0, 1.0, 0))) as s:
        async for _ in s:
            first = first or time.perf_counter() - started
    return first, time.perf_counter() - started


async def test_decode_steps_slow_down_with_the_batch():
    # Steps long enough (20 ms a sequence) that a loaded machine's scheduling delays do not blur them.
    b = SimBackend("sim-t", 4096, SimProfile(decode_ms_base=0.0, decode_ms_per_seq=20.0, output_tokens=64))
    _, alone = await timed(b, "one two", 10)
    together = await asyncio.gather(*(timed(b, f"prompt {i}", 10) for i in range(4)))
    assert min(total for _, total in together) > 2.5 * alone  # each step carries four sequences
    await b.close()


async def test_a_cached_prefix_skips_its_prefill():
    b = SimBackend("sim-t", 4096, SimProfile(prefill_ms_per_token=1.0, decode_ms_base=1.0))
    shared = " ".join(f"w{i}" for i in range(160))
    cold, _ = await timed(b, shared + " first question", 2)
    warm, _ = await timed(b, shared + " second question", 2)
    queries, hits = b.prefix_cache_stats()
    assert hits >= 160 - 16 and queries > hits
    assert warm < cold / 3, (cold, warm)
    await b.close()


async def test_a_full_kv_cache_makes_the_next_request_wait():
    b = SimBackend("sim-t", 4096, SimProfile(decode_ms_base=5.0, kv_blocks=6, block_size=16, output_tokens=64))
    long_prompt = " ".join(f"a{i}" for i in range(60))  # 60 + 20 tokens: 5 blocks
    first, second = await asyncio.gather(timed(b, long_prompt, 20), timed(b, long_prompt.replace("a", "b"), 20))
    assert second[0] >= first[1] * 0.9  # its first token only after the first request left
    await b.close()


async def test_running_sequences_share_their_prefix_blocks():
    """Two requests over one 64-token prefix: the KV cache has room for both only if the prefix's
    blocks count once, as in vLLM, and then they run together."""
    prefix = " ".join(f"p{i}" for i in range(64))
    a, c = prefix + " " + " ".join(f"a{i}" for i in range(8)), prefix + " " + " ".join(f"c{i}" for i in range(8))
    probe = SimBackend("sim-t", 4096)
    tokens_a, tokens_c = probe.tokenize(Prompt(text=a)), probe.tokenize(Prompt(text=c))
    shared = next(i for i, (x, y) in enumerate(zip(tokens_a, tokens_c)) if x != y) // 16
    each = -(-(len(tokens_a) + 20) // 16)
    assert shared >= 3
    b = SimBackend("sim-t", 4096, SimProfile(decode_ms_base=5.0, kv_blocks=2 * each - shared, output_tokens=64))
    first, second = await asyncio.gather(timed(b, a, 20), timed(b, c, 20))
    assert second[0] < first[1] / 2  # started beside the first, not after it
    assert b.kv_usage() == 0.0
    await b.close()


async def test_a_chat_follow_up_hits_the_blocks_its_previous_answer_filled():
    """The engine's own chat rendering ends a prompt in the answer's header (as a chat template's
    generation prompt), so the history a client sends back repeats the prompt and the answer token
    for token: a follow-up's prefill is its new message and the partial blocks' tail, nothing more."""
    b = SimBackend("sim-t", 4096, SimProfile(decode_ms_base=0.5, output_tokens=64))
    history = [Message("system", " ".join(f"s{i}" for i in range(100))), Message("user", "the first question")]
    first = b.tokenize(Prompt(messages=tuple(history)))
    async with aclosing(b.stream(first, DecodeParams(64, 0.0, 1.0, 0))) as s:
        answer = "".join([piece async for piece in s])
    history += [Message("assistant", answer), Message("user", "and then")]
    follow_up = b.tokenize(Prompt(messages=tuple(history)))
    before = b.prefix_cache_stats()
    async with aclosing(b.stream(follow_up, DecodeParams(1, 0.0, 1.0, 0))) as s:
        [_ async for _ in s]
    after = b.prefix_cache_stats()
    await b.close()
    assert follow_up[:len(first) + 64] == first + b.tokenize(Prompt(text=answer))
    assert after[1] - before[1] == (len(first) + 64) // 16 * 16  # the first prompt and its answer, by full block


def test_profile_round_trips(tmp_path):
    p = SimProfile(prefill_ms_per_token=0.7, decode_ms_base=3.0, decode_ms_per_seq=1.5, kv_blocks=99, max_batch=7)
    p.save(tmp_path / "p.json")
    assert SimProfile.load(tmp_path / "p.json") == p
    assert p.step_s(4, 10) == (3.0 + 1.5 * 4 + 0.7 * 10) / 1000


def test_a_piggyback_step_lasts_the_longer_of_its_decode_and_its_prefill():
    p = SimProfile(prefill_ms_per_token=0.5, decode_ms_base=10.0, decode_ms_per_seq=1.0, piggyback=True)
    assert p.step_s(4, 10) == 14 / 1000        # 5 ms of prefill rides in a 14 ms decode step
    assert p.step_s(4, 100) == 50 / 1000       # a long prefill bounds the step
    assert p.step_s(0, 100) == 50 / 1000 and p.step_s(4, 0) == 14 / 1000


async def test_waiting_sequences_start_highest_priority_first():
    """One sequence at a time: those queued behind it start by class, in arrival order within one."""
    b = SimBackend("sim-t", 4096, SimProfile(decode_ms_base=2.0, max_batch=1, output_tokens=64))
    firsts: dict[str, float] = {}

    async def run(name: str, priority: Priority):
        params = DecodeParams(5, 0.0, 1.0, 0, priority=priority)
        async with aclosing(b.stream(b.tokenize(Prompt(text=name)), params)) as s:
            async for _ in s:
                firsts.setdefault(name, time.perf_counter())

    arrivals = [("low0", Priority.LOW), ("low1", Priority.LOW), ("normal", Priority.NORMAL),
                ("low2", Priority.LOW), ("high", Priority.HIGH)]
    tasks = []
    for name, p in arrivals:
        tasks.append(asyncio.create_task(run(name, p)))
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert sorted(firsts, key=firsts.get) == ["low0", "high", "normal", "low1", "low2"]
    await b.close()


def test_prefill_first_gives_the_newcomer_its_token_a_decode_step_sooner_and_costs_the_others_nothing():
    """On the virtual clock: two sequences decode (10 ms steps), a newcomer with 30 uncached tokens
    (1 ms each) arrives. Mixed, its first token comes after its prefill and their decode together;
    with ``prefill_first`` one decode step (10 ms) sooner, and the others' tokens at the same times."""
    from bench.virtual_time import VirtualTimeLoop

    def scenario(prefill_first: bool) -> tuple[float, list[float]]:
        async def main() -> tuple[float, list[float]]:
            loop = asyncio.get_running_loop()
            b = SimBackend("sim-t", 4096, SimProfile(prefill_ms_per_token=1.0, decode_ms_base=10.0, output_tokens=64,
                                                     prefill_first=prefill_first))
            stamps: list[float] = []

            async def neighbour(i: int) -> None:
                prompt = b.tokenize(Prompt(text=f"n{i}"))
                async with aclosing(b.stream(prompt, DecodeParams(12, 0.0, 1.0, i))) as s:
                    async for _ in s:
                        if i == 0:
                            stamps.append(loop.time())

            others = [asyncio.create_task(neighbour(i)) for i in range(2)]
            await asyncio.sleep(0.035)  # mid-step: both decode
            arrived = loop.time()
            prompt = b.tokenize(Prompt(text=" ".join(f"w{i}" for i in range(30))))
            async with aclosing(b.stream(prompt, DecodeParams(1, 0.0, 1.0, 0))) as s:
                async for _ in s:
                    ttft = loop.time() - arrived
            await asyncio.gather(*others)
            await b.close()
            return ttft, stamps

        with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
            return runner.run(main())

    mixed, first = scenario(False), scenario(True)
    assert abs(mixed[0] - first[0] - 0.010) < 1e-6, (mixed[0], first[0])  # one decode step sooner
    assert 0 < first[0] - 0.030 < 0.010  # its prefill, after the step in progress
    assert first[1] == mixed[1]  # the neighbours' token times: unchanged

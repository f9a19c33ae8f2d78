"""vLLM backend (GPU) on vLLM's AsyncLLM (the v1 engine).

vLLM does the batching, paged KV cache and prefix caching; this adapter streams
token deltas, aborts a request whose stream is closed, serves LoRA adapters (loaded
at run time, chosen per request by model name, as vLLM's own server does), reads the
engine's stats for the KV-cache use we report, and relays vLLM's KV-cache events
(BlockStored / BlockRemoved / AllBlocksCleared over ZMQ) to the scheduler.

vLLM is imported only by ``VllmBackend.create``: it is the optional ``vllm`` extra
and never installed in CI. Everything else takes the engine and vLLM's few request
types as arguments, so the shared backend contract tests can drive this adapter
with a fake AsyncLLM."""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace

from llmesh.errors import InvalidArgument, NotFound
from llmesh.types import Prompt
from llmesh.engine.backends.base import DecodeParams
from llmesh.engine.kvblocks import KvEventLog

log = logging.getLogger("llmesh.engine.vllm")


class VllmBackend:
    name = "vllm"

    def __init__(self, engine, tokenizer, model: str, context_length: int, api: SimpleNamespace,
                 kv_events: KvEventLog | None = None):
        self._engine = engine
        self._tokenizer = tokenizer
        self._api = api  # SamplingParams, RequestOutputKind, LoRARequest
        self.model = model
        self.context_length = context_length
        self.vocab_size = len(tokenizer)
        self.kv_blocks = kv_events or KvEventLog()
        self._adapters: dict[str, object] = {}
        self._lora_ids = itertools.count(1)
        self._kv_usage = 0.0
        self._prefix = (0, 0)
        self._subscriber: KvEventSubscriber | None = None

    @classmethod
    def create(cls, model: str, *, max_model_len: int, gpu_memory_utilization: float = 0.85,
               max_loras: int = 4, kv_events_endpoint: str | None = None, served_name: str | None = None
               ) -> VllmBackend:
        from transformers import AutoTokenizer
        from vllm import SamplingParams
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        holder: dict[str, VllmBackend] = {}
        events = None
        if kv_events_endpoint:
            events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events_endpoint,
                                    topic="kv")
        args = AsyncEngineArgs(model=model, served_model_name=served_name or model, max_model_len=max_model_len,
                               gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                               enable_lora=True, max_loras=max_loras, kv_events_config=events)
        engine = AsyncLLM.from_engine_args(args, stat_loggers=[_stats_logger_factory(holder)])
        backend = cls(engine, AutoTokenizer.from_pretrained(model), served_name or model, max_model_len,
                      SimpleNamespace(SamplingParams=SamplingParams, RequestOutputKind=RequestOutputKind,
                                      LoRARequest=LoRARequest))
        holder["backend"] = backend
        if kv_events_endpoint:
            backend._subscriber = KvEventSubscriber(kv_events_endpoint.replace("*", "127.0.0.1"), "kv",
                                                    backend.kv_blocks)
        return backend

    @property
    def models(self) -> tuple[str, ...]:
        return (self.model, *self._adapters)

    def kv_usage(self) -> float:
        return self._kv_usage

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self._prefix

    def record_stats(self, scheduler_stats) -> None:
        """From vLLM's stat logger: KV-cache use (``kv_cache_usage``; older vLLM
        ``gpu_cache_usage``) and the step's prefix-cache queries and hits."""
        usage = getattr(scheduler_stats, "kv_cache_usage", None)
        if usage is None:
            usage = getattr(scheduler_stats, "gpu_cache_usage", 0.0)
        self._kv_usage = float(usage)
        prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
        if prefix is not None:
            self._prefix = (self._prefix[0] + prefix.queries, self._prefix[1] + prefix.hits)

    async def load_adapter(self, name: str, path: str) -> None:
        """Loads a LoRA adapter at run time; requests then choose it by model name."""
        if name in self.models:
            raise InvalidArgument(f"a model or adapter named {name!r} is already loaded", param="name")
        request = self._api.LoRARequest(name, next(self._lora_ids), path)
        if not await self._engine.add_lora(request):
            raise InvalidArgument(f"vLLM could not load the adapter at {path}", param="path")
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

    async def stream(self, tokens: list[int], params: DecodeParams) -> AsyncIterator[str]:
        lora = None
        if params.adapter is not None:
            lora = self._adapters.get(params.adapter)
            if lora is None:
                raise NotFound(f"no adapter named {params.adapter!r} is loaded")
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise InvalidArgument("the prompt holds token ids outside the vocabulary")
        sampling = self._api.SamplingParams(
            max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
            seed=params.seed, output_kind=self._api.RequestOutputKind.DELTA)
        request_id = uuid.uuid4().hex
        finished = False
        try:
            async for out in self._engine.generate({"prompt_token_ids": list(tokens)}, sampling, request_id,
                                                   lora_request=lora):
                completion = out.outputs[0]
                # One piece per token: the delta's text rides on its first token.
                for i, _ in enumerate(completion.token_ids):
                    yield completion.text if i == 0 else ""
                finished = out.finished
                if finished:
                    return
        finally:
            if not finished:
                await self._engine.abort(request_id)

    async def close(self) -> None:
        if self._subscriber is not None:
            self._subscriber.stop()
        self._engine.shutdown()


def _stats_logger_factory(holder: dict):
    """A vLLM stat logger that hands each scheduler snapshot to the backend."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Relay(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, *args, **kwargs) -> None:
            backend = holder.get("backend")
            if backend is not None and scheduler_stats is not None:
                backend.record_stats(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _Relay


def block_hash(value) -> int:
    """vLLM's block hashes are ints or (newer) sha256 bytes; we carry 64 bits."""
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(bytes(value)[:8], "little")
    return int(value) & (2**64 - 1)


def apply_vllm_events(payload: bytes, sink: KvEventLog) -> int:
    """Decodes one of vLLM's ``KVEventBatch`` messages (msgpack: [ts, [event, ...]],
    each event an array tagged with its class name) into ``sink``; returns the count."""
    import msgspec

    _ts, events = msgspec.msgpack.decode(payload)
    for event in events:
        tag, fields = event[0], event[1:]
        if tag == "BlockStored":
            hashes, parent = fields[0], fields[1] if len(fields) > 1 else None
            sink.stored([block_hash(h) for h in hashes], block_hash(parent) if parent is not None else 0)
        elif tag == "BlockRemoved":
            sink.removed([block_hash(h) for h in fields[0]])
        elif tag == "AllBlocksCleared":
            sink.cleared()
        else:
            log.warning("unknown vLLM KV event", extra={"tag": str(tag)})
    return len(events)


class KvEventSubscriber:
    """A thread on a ZMQ SUB socket at vLLM's KV-event endpoint: multipart messages
    [topic, sequence number, payload]. A gap in sequence numbers means events were
    lost; we then say 'cleared' and rebuild from what comes next."""

    def __init__(self, endpoint: str, topic: str, sink: KvEventLog):
        import zmq

        self._sink = sink
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._last_seq: int | None = None
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                _topic, seq_bytes, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if self._last_seq is not None and seq != self._last_seq + 1:
                log.warning("vLLM KV events lost; resetting", extra={"expected": self._last_seq + 1, "got": seq})
                self._sink.cleared()
            self._last_seq = seq
            try:
                apply_vllm_events(payload, self._sink)
            except Exception:  # noqa: BLE001 - one bad message must not stop the relay
                log.exception("undecodable vLLM KV event batch")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)


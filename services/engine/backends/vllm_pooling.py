"""vLLM pooling models: embeddings on vLLM's AsyncLLM with its pooling runner (Embed only:
Generate is refused, ``Capabilities.generates`` is False).

vLLM reads the model's own pooling and normalization where a sentence-transformers directory
states them (modules.json's Pooling module and its config, a Normalize module: mean pooling,
L2-normalised for all-MiniLM-L6-v2), and its input limit (sentence_bert_config.json's
max_seq_length: 256 for MiniLM), which becomes ``max_input_tokens``: the engine core refuses a
longer input, never truncates it. Each input is one ``AsyncLLM.encode`` request (vLLM batches
them); ``embed`` is a coroutine the core awaits, and cancelling it aborts the requests.

The engine arguments are the vllm backend's (``vllm_args.pooling_engine_args``), so the GPU
path's settings (dtype, tensor parallel size, extra AsyncEngineArgs) apply here too. vLLM is
imported only by ``create`` and ``serves_pooling``; the rest takes the engine as an argument."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

from llmesh.errors import InvalidArgument
from llmesh.engine.backends.base import Capabilities, EmbeddingOnly
from llmesh.engine.backends.vllm_args import VllmEngineOptions, async_engine_arg_fields, pooling_engine_args
from llmesh.engine.kvblocks import KvEventLog


def serves_pooling(source: str, runner: str) -> bool:
    """Whether a vllm engine serves the model at ``source`` with vLLM's pooling runner.
    ``runner`` is LLMESH_ENGINE_VLLM_RUNNER: ``pooling`` or ``generate`` as it says; ``auto``
    as vLLM's own ``auto`` decides first: pooling for a sentence-transformers model (modules.json
    names a Pooling module), else generate."""
    if runner != "auto":
        return runner == "pooling"
    from vllm.transformers_utils.config import get_pooling_config

    return get_pooling_config(source) is not None


class VllmPoolingBackend(EmbeddingOnly):
    name = "vllm"
    capabilities = Capabilities(generates=False, embeddings=True)
    vocab_size = 0  # nothing is sampled

    def __init__(self, engine, tokenizer, model: str, max_input_tokens: int, api: SimpleNamespace,
                 gpu_memory_share: float = 0.0):
        self._engine = engine
        self._tokenizer = tokenizer
        self._api = api  # PoolingParams, ClientError
        self.model = model
        self.models = (model,)
        self.max_input_tokens = max_input_tokens
        self.context_length = max_input_tokens  # what the scheduler and gateways learn of it
        self.gpu_memory_share = gpu_memory_share
        self.kv_blocks = KvEventLog()  # no KV cache kept between requests: no events

    @classmethod
    def create(cls, model: str, *, served_name: str | None = None, max_model_len: int | None = None,
               gpu_memory_utilization: float = 0.85,
               options: VllmEngineOptions | None = None) -> VllmPoolingBackend:
        """vLLM's engine for the model at ``model`` (``max_model_len`` None: the model's own limit)."""
        from vllm import PoolingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.async_llm import AsyncLLM

        options = options or VllmEngineOptions()
        options.check(async_engine_arg_fields(AsyncEngineArgs))  # before vLLM loads anything
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**pooling_engine_args(
            model, served_name=served_name, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, options=options)))
        return cls(engine, engine.get_tokenizer(), served_name or model, engine.vllm_config.model_config.max_model_len,
                   SimpleNamespace(PoolingParams=PoolingParams, ClientError=VLLMClientError),
                   gpu_memory_share=gpu_memory_utilization)

    def tokenize_inputs(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids with the model's special tokens ([CLS] ... [SEP] for BERT), not truncated."""
        return [list(ids) for ids in self._tokenizer(texts)["input_ids"]]

    async def embed(self, token_ids: list[list[int]]) -> list[list[float]]:
        """One vector per input, each from its own request (vLLM batches them). Cancelled, or
        one request failing: the others are aborted (a task group cancels them, and vLLM's
        ``encode`` aborts a cancelled request)."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._embed_one(ids)) for ids in token_ids]
        except ExceptionGroup as failed:  # the first failure, as the core maps single errors
            first = failed.exceptions[0]
            if isinstance(first, (ValueError, self._api.ClientError)):
                # vLLM refuses what it cannot serve with a client error or ValueError (its server answers 4xx)
                raise InvalidArgument(f"vLLM refused the request: {str(first)[:300]}") from None
            raise first from None
        return [task.result() for task in tasks]

    async def _embed_one(self, ids: list[int]) -> list[float]:
        out = None
        async for out in self._engine.encode({"prompt_token_ids": ids}, self._api.PoolingParams(task="embed"),
                                             uuid.uuid4().hex):
            pass
        if out is None:
            raise RuntimeError("vLLM's engine answered an embedding request with nothing")
        vector: list[float] = out.outputs.data.tolist()
        return vector

    async def close(self) -> None:
        self._engine.shutdown()

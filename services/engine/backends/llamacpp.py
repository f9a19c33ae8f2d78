"""llama.cpp backend (CPU) through llama-cpp-python, with continuous batching.

The tokenizer and chat template come from a vocab-only ``Llama`` (``GgufChatTokenizer``); the weights are
loaded once through the low-level API and decoded by a ``BatchRunner`` (see
``llamacpp_batch``), which serves up to ``n_slots`` sequences together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path

from llmesh.errors import Internal, NotFound
from llmesh.modelstore import ModelStore, quiet_native_stderr
from llmesh.prompt_tokens import GgufChatTokenizer
from llmesh.tool_prompt import render
from llmesh.types import Prompt, Tools
from llmesh.engine.backends.base import ALL_KNOBS, Capabilities, DecodeParams, Piece
from llmesh.engine.backends.llamacpp_batch import BatchRunner, Sequence
from llmesh.engine.backends.llamacpp_grammar import GrammarCompiler
from llmesh.engine.kvblocks import BlockLedger
from llmesh.engine.toolcalls import CallReader


class LlamaCppBackend:
    name = "llamacpp"
    capabilities = Capabilities(logprobs=True, response_format=True, continuation=True, steps=True, knobs=ALL_KNOBS,
                                tools=True)
    gpu_memory_share = 0.0

    def __init__(self, model_path: Path, model: str, *, n_ctx: int, n_threads: int, n_batch: int, n_slots: int,
                 unified_kv: bool = False):
        import llama_cpp

        self.model = model
        self.models = (model,)
        self.kv_blocks = BlockLedger()  # owners are KV slots: a slot's cached prefix stays until reused
        self._tokenizer = GgufChatTokenizer(model_path)  # the gateway hashes prompts with the same one
        self._vocab = self._tokenizer.vocab
        with quiet_native_stderr():
            params = llama_cpp.llama_model_default_params()
            self._model_p = llama_cpp.llama_model_load_from_file(str(model_path).encode(), params)
        if not self._model_p:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.context_length = min(n_ctx, llama_cpp.llama_model_n_ctx_train(self._model_p))
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model_p))
        self._loop: asyncio.AbstractEventLoop | None = None
        # response formats' grammars: converted and parsed once off the event loop and decode thread
        self._grammars = GrammarCompiler(llama_cpp.llama_model_get_vocab(self._model_p))
        with quiet_native_stderr():
            self._runner = BatchRunner(self._model_p, llama_cpp.llama_model_get_vocab(self._model_p),
                                       n_slots=n_slots, n_ctx_per_seq=self.context_length, n_threads=n_threads,
                                       n_batch=n_batch, unified_kv=unified_kv, deliver=self._deliver,
                                       on_blocks=self._on_blocks)

    @classmethod
    def from_store(cls, model_dir: Path, model: str, **kwargs) -> LlamaCppBackend:
        return cls(ModelStore(model_dir).gguf(model), model, **kwargs)

    def _on_blocks(self, slot: int, tokens: list[int], reset: bool) -> None:
        if reset:
            self.kv_blocks.hold(slot, tokens)
        else:
            self.kv_blocks.grow(slot, tokens)

    def kv_usage(self) -> float:
        """Share of the KV cells that running sequences hold."""
        return self._runner.cells_in_use() / (self._runner.n_slots * self.context_length)

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self._runner.prefix_queries, self._runner.prefix_hits

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self._tokenizer(prompt)

    def tokenize_chat(self, prompt: Prompt, tools: Tools | None) -> list[int]:
        """Tools shown in llmesh.tool_prompt's Hermes format, which its grammar enforces, for any chat template."""
        return self._tokenizer(render(prompt, tools))

    def call_reader(self, tools: Tools, stops: tuple[str, ...]) -> CallReader:
        return CallReader(tools.choice != "auto", stops)

    def tokenize_continuation(self, text: str) -> list[int]:
        """Tokens of answer text already produced elsewhere (no BOS, no special tokens)."""
        return self._vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def _deliver(self, results) -> None:
        """Called on the decode thread once per step; one wake-up of the loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(_dispatch, results)

    async def stream(self, tokens: list[int], params: DecodeParams) -> AsyncGenerator[Piece, None]:
        async with aclosing(self.stream_steps(tokens, params)) as steps:
            async for pieces in steps:
                for piece in pieces:
                    yield piece

    async def stream_steps(self, tokens: list[int], params: DecodeParams) -> AsyncGenerator[list[Piece], None]:
        """``stream``'s pieces, every piece ready at once in one list: a step's, or several
        steps' when the consumer fell behind."""
        if params.adapter is not None:
            raise NotFound(f"the llamacpp backend serves no adapters; {params.adapter!r} is not loaded")
        self._loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        fmt = params.response_format
        if params.tools is not None:
            grammar: str | None = await self._grammars.tools_grammar(params.tools)
        else:
            grammar = await self._grammars.grammar(fmt) if fmt is not None else None
        answered = list(tokens[len(tokens) - params.continued_tokens:]) if params.continued_tokens else []
        seq = Sequence(prompt=list(tokens), params=params, sink=queue, grammar=grammar, answered=answered)
        self._runner.submit(seq)
        done = False
        try:
            while not done:
                batch: list = []
                entry = await queue.get()
                while True:
                    pieces, error, done = entry
                    if error is not None:
                        if batch:
                            yield batch
                        raise Internal(f"llama.cpp failed this request: {error}") from error
                    batch.extend(pieces)
                    if done or queue.empty():
                        break
                    entry = queue.get_nowait()
                if batch:
                    yield batch
        finally:
            if not done:
                self._runner.cancel(seq)
                while not (await queue.get())[2]:  # the slot is ours until the runner lets go
                    pass

    async def close(self) -> None:
        import llama_cpp

        self._grammars.close()
        await asyncio.to_thread(self._runner.stop)
        llama_cpp.llama_model_free(self._model_p)
        self._vocab.close()


def _dispatch(results) -> None:
    for seq, pieces, error, done in results:
        seq.sink.put_nowait((pieces, error, done))

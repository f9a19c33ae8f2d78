"""llama.cpp backend (CPU) through llama-cpp-python.

One model, one sequence at a time: the high-level ``Llama.generate`` runs in a
single worker thread so decoding never blocks the event loop, and it reuses the
KV cache of the longest prompt prefix it saw last. Tokens cross back to the loop
one by one; closing the stream sets a flag the thread checks after each token."""

from __future__ import annotations

import asyncio
import codecs
import random
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llmesh.errors import ModelNotFound
from llmesh.modelstore import ModelStore, quiet_native_stderr
from llmesh.types import Prompt
from llmesh.engine.backends.base import DecodeParams

_END = object()


class LlamaCppBackend:
    name = "llamacpp"

    def __init__(self, llm, model: str):
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self._llm = llm
        self.model = model
        self.context_length = llm.n_ctx()
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self._is_eog: Callable[[int], bool] = lambda tok: bool(llama_cpp.llama_vocab_is_eog(vocab, tok))
        template = llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise ValueError(f"{model}: the GGUF carries no chat template")
        self._formatter = Jinja2ChatFormatter(template=template, eos_token=self._special_text(llm.token_eos()),
                                              bos_token=self._special_text(llm.token_bos()))
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamacpp")

    def _special_text(self, token: int) -> str:
        return self._llm.detokenize([token], special=True).decode("utf-8", "replace") if token >= 0 else ""

    @classmethod
    def from_store(cls, model_dir: Path, model: str, *, n_ctx: int, n_threads: int, n_batch: int
                   ) -> LlamaCppBackend:
        from llama_cpp import Llama

        record = ModelStore(model_dir).get(model)
        if record is None or record.format != "gguf":
            raise ModelNotFound(model)
        if record.context_length:
            n_ctx = min(n_ctx, record.context_length)
        with quiet_native_stderr():
            llm = Llama(model_path=str(record.path), n_ctx=n_ctx, n_threads=n_threads,
                        n_threads_batch=n_threads, n_batch=n_batch, verbose=False)
        return cls(llm, model)

    def kv_usage(self) -> float:
        """Share of the context's KV cells holding tokens (one sequence: its length)."""
        return self._llm.n_tokens / self.context_length

    def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            text = self._formatter(messages=[{"role": m.role, "content": m.content}
                                             for m in prompt.messages]).prompt
            return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        return self._llm.tokenize((prompt.text or "").encode("utf-8"), add_bos=True, special=False)

    async def stream(self, tokens: list[int], params: DecodeParams) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def emit(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        done = loop.run_in_executor(self._worker, self._decode, tokens, params, emit, cancel)
        try:
            while (item := await queue.get()) is not _END:
                yield item
            await done  # re-raises a failure inside llama.cpp
        finally:
            cancel.set()
            # The slot is ours until the thread has let go of the model.
            await asyncio.wait([done])

    def _decode(self, tokens: list[int], params: DecodeParams, emit: Callable[[object], None],
                cancel: threading.Event) -> None:
        llm = self._llm
        try:
            llm.set_seed(params.seed % 2**32 if params.seed is not None else random.getrandbits(32))
            utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            produced = 0
            # OpenAI semantics: temperature and top_p only; llama.cpp's other samplers off.
            for token in llm.generate(tokens, temp=params.temperature, top_p=params.top_p, top_k=0,
                                      min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True):
                if cancel.is_set() or self._is_eog(token):
                    break
                emit(utf8.decode(llm.detokenize([token])))
                produced += 1
                if produced >= params.max_new_tokens:
                    break
        finally:
            emit(_END)

    async def close(self) -> None:
        await asyncio.to_thread(self._worker.shutdown, wait=True, cancel_futures=True)
        self._llm.close()

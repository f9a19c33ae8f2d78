"""The engine core with an embedding backend whose ``embed`` is a coroutine function (as vLLM's
pooling backend's is): awaited on the event loop, not run in a thread; a cancelled request
cancels it at once and frees its slot; its self-test awaits it too. A blocking ``embed`` still
runs in a thread (tests/component/test_embeddings_engine.py runs the minilm one)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from llmesh.engine.admission import Admission
from llmesh.engine.backends.base import Capabilities
from llmesh.engine.core import EngineCore, run_embed
from llmesh.engine.kvblocks import KvEventLog


class AsyncEmbedder:
    name = "fake-async"
    model = "emb"
    models = ("emb",)
    capabilities = Capabilities(generates=False, embeddings=True)
    context_length = max_input_tokens = 8
    vocab_size = 0
    gpu_memory_share = 0.0

    def __init__(self) -> None:
        self.kv_blocks = KvEventLog()
        self.threads: list[str] = []
        self.release = asyncio.Event()
        self.hold = False
        self.cancelled = 0

    def tokenize_inputs(self, texts: list[str]) -> list[list[int]]:
        return [[len(word) for word in text.split()] for text in texts]

    async def embed(self, token_ids: list[list[int]]) -> list[list[float]]:
        self.threads.append(threading.current_thread().name)
        try:
            if self.hold:
                await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return [[float(sum(ids)), float(len(ids))] for ids in token_ids]


class BlockingEmbedder(AsyncEmbedder):
    def embed(self, token_ids: list[list[int]]) -> list[list[float]]:  # type: ignore[override]
        self.threads.append(threading.current_thread().name)
        return [[float(len(ids))] for ids in token_ids]


async def test_an_async_embed_is_awaited_on_the_loop_in_a_slot():
    backend = AsyncEmbedder()
    core = EngineCore(backend, Admission(1, 1))
    got = await core.embed("emb", ["a bb", "ccc"])
    assert got.vectors == [[3.0, 2.0], [3.0, 1.0]] and got.prompt_tokens == 3
    assert backend.threads == [threading.current_thread().name]  # not a worker thread
    ok, why, _ = await core.self_test()
    assert ok, why


async def test_cancelling_an_async_embed_cancels_it_and_frees_the_slot():
    backend = AsyncEmbedder()
    backend.hold = True
    admission = Admission(1, 1)
    core = EngineCore(backend, admission)
    request = asyncio.create_task(core.embed("emb", ["a"]))
    while not backend.threads:
        await asyncio.sleep(0)
    assert admission.running == 1
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert backend.cancelled == 1 and admission.running == 0


async def test_a_blocking_embed_still_runs_in_a_thread():
    backend = BlockingEmbedder()
    assert await run_embed(backend, [[1, 2], [3]]) == [[2.0], [1.0]]
    assert backend.threads and backend.threads[0] != threading.current_thread().name

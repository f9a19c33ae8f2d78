"""POST /v1/embeddings and gRPC Embed on a real mesh: `llmesh up` with a sim engine and, as
`make run` has it, the embedding engine (backend minilm) serving the real all-MiniLM-L6-v2;
API keys made with the `llmesh keys` CLI for two tenants, one granted the embedder. Driven by
the official openai package, httpx and a gRPC client; the vectors are checked against the
ones sentence-transformers itself produced (tests/data/minilm_reference.json)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest

from llmesh.client import AsyncClient, Client, InvalidArgumentError
from llmesh.testing import Mesh, free_layout, wait_until
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

EMBED = "all-minilm-l6-v2"
SIM = "sim-small"
REFERENCE = json.loads((Path(__file__).resolve().parents[1] / "data" / "minilm_reference.json").read_text())
CONFIG = {"tenants": {"acme": {"models": [SIM, EMBED]}, "other": {"models": [SIM]}, "open": {}},
          "rate_limits": {"acme": {"tokens_per_minute": 1000000}}}


def _key(state: Path, tenant: str) -> str:
    out = subprocess.run([sys.executable, "-m", "llmesh", "keys", "create", "--tenant", tenant],
                         env={**os.environ, "LLMESH_STATE_DIR": str(state)}, capture_output=True, text=True,
                         timeout=30, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def emesh(tmp_path_factory, real_model_dir: Path):
    root = tmp_path_factory.mktemp("embed")
    logs = root / "logs"
    keys = {tenant: _key(logs / "state", tenant) for tenant in ("acme", "other", "open")}  # before start: keys required
    config = root / "llmesh.yaml"
    config.write_text(json.dumps(CONFIG))
    layout = free_layout(n_engines=2)
    mesh = Mesh(layout=layout, engines="sim", model_dir=real_model_dir, log_dir=logs, embeddings=True,
                env={"LLMESH_CONFIG_FILE": str(config)}, args=["--no-cache"])
    mesh.start()
    try:
        client = openai.OpenAI(base_url=layout.http_url + "/v1", api_key=keys["acme"], max_retries=0)
        assert wait_until(lambda: EMBED in {m.id for m in client.models.list().data}, 30), mesh.logs()
        yield {"mesh": mesh, "layout": layout, "keys": keys, "client": client, "logs": logs}
    finally:
        assert mesh.stop() == 0, mesh.logs()


def _close(got, expected) -> float:
    return float(np.abs(np.asarray(got, dtype=np.float32) - np.asarray(expected, dtype=np.float32)).max())


def test_vectors_equal_sentence_transformers_as_float_and_base64_in_order(emesh, minilm):
    client = emesh["client"]
    texts = REFERENCE["texts"]
    # the openai client asks for base64 unless told, and decodes it (little-endian float32)
    for fmt in (openai.NOT_GIVEN, "float"):
        resp = client.embeddings.create(model=EMBED, input=texts, encoding_format=fmt)
        assert resp.object == "list" and resp.model == EMBED
        assert [d.index for d in resp.data] == list(range(len(texts)))
        for d, expected in zip(resp.data, REFERENCE["vectors"]):
            assert d.object == "embedding" and len(d.embedding) == 384
            assert _close(d.embedding, expected) < 1e-5
        tokens = sum(len(minilm.tokenize(t)) for t in texts)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == tokens
    asked = client.embeddings.create(model=EMBED, input=texts[:2], encoding_format="base64")  # left encoded
    for d, expected in zip(asked.data, REFERENCE["vectors"]):
        assert isinstance(d.embedding, str)
        assert _close(np.frombuffer(base64.b64decode(d.embedding), dtype="<f4"), expected) < 1e-5
    reversed_ = client.embeddings.create(model=EMBED, input=texts[::-1])
    for d, expected in zip(reversed_.data, REFERENCE["vectors"][::-1]):
        assert _close(d.embedding, expected) < 1e-5
    one = client.embeddings.create(model=EMBED, input=texts[0])
    assert len(one.data) == 1 and _close(one.data[0].embedding, REFERENCE["vectors"][0]) < 1e-5


def test_the_wrong_kind_of_model_and_bad_inputs_are_refused(emesh):
    client = emesh["client"]
    anything = openai.OpenAI(base_url=emesh["layout"].http_url + "/v1", api_key=emesh["keys"]["open"], max_retries=0)
    with pytest.raises(openai.NotFoundError):  # a tenant granted every model: no such model (acme's grant: 403)
        anything.embeddings.create(model="no-such-model", input="hi")
    with pytest.raises(openai.BadRequestError) as chat_model:
        client.embeddings.create(model=SIM, input="hi")
    assert chat_model.value.code == "model_not_embedding"
    with pytest.raises(openai.BadRequestError) as embed_model:
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    assert embed_model.value.code == "model_not_generative"
    with pytest.raises(openai.BadRequestError) as long:
        client.embeddings.create(model=EMBED, input=["fine", "word " * 300])
    assert long.value.code == "context_length_exceeded" and "256 tokens" in long.value.message
    assert long.value.param == "input[1]"
    with pytest.raises(openai.BadRequestError) as dims:
        client.embeddings.create(model=EMBED, input="hi", dimensions=128)
    assert dims.value.param == "dimensions"
    url, auth = emesh["layout"].http_url + "/v1/embeddings", {"authorization": f"Bearer {emesh['keys']['acme']}"}
    for body, param in (({"model": EMBED, "input": [101, 102]}, "input"), ({"model": EMBED, "input": []}, "input"),
                        ({"model": EMBED, "input": [""]}, "input[0]"),
                        ({"model": EMBED, "input": "hi", "encoding_format": "int8"}, "encoding_format"),
                        ({"model": EMBED, "input": "hi", "temperature": 1}, "temperature")):
        r = httpx.post(url, json=body, headers=auth, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_grants_limits_and_audit_apply(emesh):
    layout, keys = emesh["layout"], emesh["keys"]
    other = openai.OpenAI(base_url=layout.http_url + "/v1", api_key=keys["other"], max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        other.embeddings.create(model=EMBED, input="hi")
    assert EMBED not in {m.id for m in other.models.list().data}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=layout.http_url + "/v1", api_key="nope", max_retries=0).embeddings.create(
            model=EMBED, input="hi")
    raw = emesh["client"].embeddings.with_raw_response.create(model=EMBED, input=["audited text"])
    assert raw.headers["x-ratelimit-limit-tokens"] == "1000000"
    rid = raw.headers["x-request-id"]
    audit = emesh["logs"] / "state" / "audit.jsonl"

    def record() -> dict | None:
        lines = audit.read_text().splitlines() if audit.is_file() else []
        return next((r["fields"] for r in map(json.loads, lines) if r["fields"].get("request_id") == rid), None)
    assert wait_until(lambda: record() is not None, 10)
    found = record()
    assert found is not None and found["operation"] == "embeddings" and found["status"] == "ok"
    assert found["prompt_tokens"] == raw.parse().usage.prompt_tokens and found["completion_tokens"] == 0


def test_the_model_list_puts_a_chat_model_first_and_says_what_each_serves(emesh):
    client = emesh["client"]
    models = client.models.list().data
    first = models[0]
    answer = client.chat.completions.create(model=first.id, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4)
    assert answer.choices[0].message.content
    caps = {m.id: m.model_extra["capabilities"] for m in models}
    assert caps[EMBED] == ["embeddings"] and caps[SIM] == ["chat", "completions"]


def test_grpc_embed(emesh):
    metadata = (("authorization", f"Bearer {emesh['keys']['acme']}"),)
    with grpc.insecure_channel(emesh["layout"].address("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        resp = stub.Embed(gateway_pb2.GatewayEmbedRequest(model=EMBED, inputs=REFERENCE["texts"][:3]),
                          metadata=metadata, timeout=30)
        assert resp.model == EMBED and len(resp.embeddings) == 3 and resp.usage.prompt_tokens > 0
        for e, expected in zip(resp.embeddings, REFERENCE["vectors"]):
            assert _close(list(e.values), expected) < 1e-5
        with pytest.raises(grpc.RpcError) as chat_model:
            stub.Embed(gateway_pb2.GatewayEmbedRequest(model=SIM, inputs=["hi"]), metadata=metadata, timeout=30)
        assert chat_model.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as empty:
            stub.Embed(gateway_pb2.GatewayEmbedRequest(model=EMBED), metadata=metadata, timeout=30)
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs" in empty.value.details()
        with pytest.raises(grpc.RpcError) as chat:
            list(stub.Chat(gateway_pb2.ChatRequest(model=EMBED, messages=[common_pb2.ChatMessage(
                role="user", content="hi")]), metadata=metadata, timeout=30))
        assert chat.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        listed = stub.ListModels(gateway_pb2.GatewayListModelsRequest(), metadata=metadata, timeout=10)
        serves = {m.name: list(m.serves) for m in listed.details}
        assert serves[EMBED] == [gateway_pb2.MODEL_API_EMBEDDINGS] and listed.details[0].name != EMBED


def test_llmesh_client_embeds_blocking_and_async(emesh):
    address, key = emesh["layout"].address("gateway"), emesh["keys"]["acme"]
    with Client(address, credential=key, timeout_s=30) as client:
        resp = client.embed(model=EMBED, inputs=REFERENCE["texts"][:2])
        with pytest.raises(InvalidArgumentError):
            client.embed(model=SIM, inputs=["hi"])
    assert [_close(list(e.values), want) < 1e-5 for e, want in zip(resp.embeddings, REFERENCE["vectors"])] == [True] * 2

    async def embed_async() -> list:
        async with AsyncClient(address, credential=key, timeout_s=30) as aclient:
            return list((await aclient.embed(model=EMBED, inputs=REFERENCE["texts"][2:3])).embeddings)
    [third] = asyncio.run(embed_async())
    assert _close(list(third.values), REFERENCE["vectors"][2]) < 1e-5


def test_the_semantic_cache_embeds_through_the_gateways_own_embeddings(emesh, minilm, monkeypatch):
    """The cache's endpoint embedder (cache.embedder kind openai) pointed at llmesh's own gateway:
    its identity is the gateway's model and the dimension it returned, its key a tenant's API key,
    and its vectors are the engine's MiniLM ones."""
    from llmesh.liveconfig.schema import CacheEmbedder
    from llmesh.cache.embedders import EmbedderSecrets, build_embedder
    url = emesh["layout"].http_url + "/v1"
    monkeypatch.setenv("LLMESH_TEST_EMBED_KEY", emesh["keys"]["acme"])
    secrets = EmbedderSecrets(key_envs=frozenset({"LLMESH_TEST_EMBED_KEY"}))
    spec = CacheEmbedder(kind="openai", base_url=url, model=EMBED, api_key_env="LLMESH_TEST_EMBED_KEY")
    embedder = build_embedder(spec, Path("unused"), secrets)
    assert embedder.identity == f"openai:{url}:{EMBED}:384"
    text = "How can I reset my password?"
    assert float(embedder.encode(text) @ minilm.encode(text)) > 0.9999
    refused = CacheEmbedder(kind="openai", base_url=url, model=EMBED)  # no key: the gateway says 401
    with pytest.raises(httpx.HTTPStatusError):
        build_embedder(refused, Path("unused"), secrets)

"""The semantic cache's embedder chosen in live config: the cache service in process over real
gRPC, on the in-process store and on a real redis-server, switching between the default MiniLM
and an OpenAI-compatible /v1/embeddings endpoint. A change of embedder starts a fresh index and
never serves an entry another embedder embedded, even when both would find the paraphrase.

``MiniLMEmbeddingsServer`` is a FAKE embeddings provider: a small aiohttp server that answers
OpenAI's /v1/embeddings with the real MiniLM's vectors (so, were the scopes mixed, its vectors
would match the old entries: the test would see it) and records what it was sent."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from llmesh.liveconfig.schema import MeshConfig
from tests.component.helpers import serving
from tests.component.test_cache_service import CacheApps, Running, query

QUESTION, PARAPHRASE = "How do I reset my password?", "How can I reset my password?"


class MiniLMEmbeddingsServer:
    """FAKE: OpenAI's embeddings API over the real MiniLM."""

    def __init__(self, minilm):
        self._minilm = minilm
        self.inputs: list[str] = []
        self.auth: list[str | None] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.auth.append(request.headers.get("authorization"))
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        self.inputs.extend(texts)
        data = [{"object": "embedding", "index": i, "embedding": self._minilm.encode(t).tolist()}
                for i, t in enumerate(texts)]
        return web.json_response({"object": "list", "model": body["model"], "data": data,
                                  "usage": {"prompt_tokens": len(texts), "total_tokens": len(texts)}})


@pytest.fixture
async def endpoint(minilm):
    fake = MiniLMEmbeddingsServer(minilm)
    app = web.Application()
    app.router.add_post("/v1/embeddings", fake.handle)
    async with serving(app) as port:
        yield fake, f"http://127.0.0.1:{port}/v1"


def config(embedder: dict | None = None) -> MeshConfig:
    cache = {"mode": "semantic", "semantic_threshold": 0.8}
    if embedder is not None:
        cache["embedder"] = embedder
    return MeshConfig.model_validate({"cache": cache})


@pytest.fixture(params=["memory", "redis"])
async def start(request, redis_server, minilm_dir, monkeypatch):
    monkeypatch.setenv("EMBED_TEST_KEY", "sk-test-embed")
    apps = CacheApps(redis_server.url, minilm_dir, backend=request.param, embed_key_envs="EMBED_TEST_KEY")
    yield apps.start, request.param
    await apps.stop()


async def switch(r: Running, mesh: MeshConfig) -> None:
    r.config(mesh)
    assert await r.app.embedders.ready(mesh.cache.embedder) is not None


async def test_changing_the_embedder_starts_a_fresh_index_and_never_serves_the_old_ones(start, endpoint):
    start, backend = start
    fake, url = endpoint
    over_http = config({"kind": "openai", "base_url": url, "model": "minilm-over-http",
                        "api_key_env": "EMBED_TEST_KEY"})
    a = await start(config())
    assert await a.store(query(QUESTION), "Use the reset link.")
    assert (await a.lookup(query(PARAPHRASE))).hit  # MiniLM's entry, found by MiniLM

    await switch(a, over_http)
    identity = a.app.embedders(over_http.cache.embedder).identity
    assert identity == f"openai:{url}:minilm-over-http:384"  # the model and the dimension it returned
    assert (await a.lookup(query(QUESTION))).hit  # an exact hit needs no embedding
    missed = await a.lookup(query(PARAPHRASE))
    assert not missed.hit  # the same vectors, but embedded by another embedder: never served
    assert PARAPHRASE in fake.inputs and set(fake.auth) == {"Bearer sk-test-embed"}

    assert await a.store(query(QUESTION), "Use the reset link, v2.")  # embedded by the endpoint now
    found = await a.lookup(query(PARAPHRASE))
    assert found.hit and found.response.text == "Use the reset link, v2." and found.similarity >= 0.8

    await switch(a, config())  # back to MiniLM: the only semantic entry is the endpoint's
    assert not (await a.lookup(query(PARAPHRASE))).hit
    if backend == "redis":  # a replica that starts now indexes what Redis holds: still nothing for MiniLM
        b = await start(config())
        for _ in range(200):
            if b.app.cache.semantic_indexed >= 1:
                break
            await asyncio.sleep(0.05)
        assert b.app.cache.semantic_indexed == 1
        assert not (await b.lookup(query(PARAPHRASE))).hit
        await switch(b, over_http)
        assert (await b.lookup(query(PARAPHRASE))).response.text == "Use the reset link, v2."


async def test_an_endpoint_that_cannot_serve_leaves_exact_matching_working(start, endpoint):
    start, _ = start
    fake, url = endpoint
    a = await start(config())
    assert await a.store(query(QUESTION), "Use the reset link.")
    refused_key = config({"kind": "openai", "base_url": url, "model": "m", "api_key_env": "HOME"})  # not allowed
    away = config({"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"})  # nothing listens
    for mesh in (refused_key, away):
        a.config(mesh)
        assert await a.app.embedders.ready(mesh.cache.embedder) is None
        assert (await a.lookup(query(QUESTION))).hit  # exact
        assert not (await a.lookup(query(PARAPHRASE))).hit  # no embedder: exact only, no error
    assert fake.auth == []  # a key the cache may not read: nothing was sent

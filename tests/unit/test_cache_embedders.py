"""The cache's embedder choice: the live config's rules, where a key may come from, the scope that
names the embedder, and Embedders (built off the loop, retried, a few kept)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pydantic import ValidationError

from llmesh.liveconfig.schema import CacheEmbedder
from llmesh.cache.embedders import EmbedderRefused, EmbedderSecrets, Embedders, build_embedder
from llmesh.cache.keys import embedded_scope


def test_the_live_config_takes_only_coherent_embedders():
    assert CacheEmbedder().kind == "local" and CacheEmbedder().model is None
    CacheEmbedder(kind="openai", base_url="https://api.example.com/v1", model="text-embedding-3-small",
                  api_key_env="OPENAI_API_KEY")
    for bad in ({"kind": "openai", "model": "m"}, {"kind": "openai", "base_url": "https://x/v1"},
                {"kind": "openai", "base_url": "http://example.com/v1", "model": "m"},  # clear text off the host
                {"kind": "local", "base_url": "https://x/v1"}, {"kind": "local", "api_key_env": "K"},
                {"kind": "local", "model": "../elsewhere"}, {"kind": "local", "model": "a/b"},
                {"kind": "openai", "base_url": "https://x/v1", "model": "m", "timeout_s": 0}):
        with pytest.raises(ValidationError):
            CacheEmbedder.model_validate(bad)


def test_an_endpoints_key_comes_only_from_the_allowed_sources(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "embed").write_text("sk-file\n")
    (tmp_path / "outside").write_text("sk-outside")
    monkeypatch.setenv("ALLOWED_KEY", "sk-env")
    monkeypatch.setenv("OTHER_KEY", "sk-other")
    secrets = EmbedderSecrets(keys, frozenset({"ALLOWED_KEY"}))

    def spec(**key) -> CacheEmbedder:
        return CacheEmbedder(kind="openai", base_url="https://x/v1", model="m", **key)

    assert secrets.api_key(spec()) is None
    assert secrets.api_key(spec(api_key_env="ALLOWED_KEY")) == "sk-env"
    assert secrets.api_key(spec(api_key_file="embed")) == "sk-file"
    for refused in (spec(api_key_env="OTHER_KEY"), spec(api_key_file="../outside"),
                    spec(api_key_file=str(tmp_path / "outside")), spec(api_key_file="missing")):
        with pytest.raises(EmbedderRefused):
            secrets.api_key(refused)
    with pytest.raises(EmbedderRefused):
        EmbedderSecrets().api_key(spec(api_key_file="embed"))


def test_a_local_model_is_a_directory_beside_the_default(tmp_path):
    default = tmp_path / "models" / "all-minilm-l6-v2"
    default.mkdir(parents=True)
    with pytest.raises(EmbedderRefused, match="no model.safetensors"):
        build_embedder(CacheEmbedder(model="other"), default, EmbedderSecrets())


def test_the_scope_names_the_embedder():
    a, b = embedded_scope("local:minilm:0123", "s"), embedded_scope("openai:http://x/v1:m:384", "s")
    assert a != b and a.endswith(":s") and a == embedded_scope("local:minilm:0123", "s")


class Fixed:
    def __init__(self, identity: str):
        self.identity = identity
        self.closed = False

    def encode(self, text: str) -> np.ndarray:
        return np.ones(3, dtype=np.float32) / np.sqrt(3)

    def close(self) -> None:
        self.closed = True


async def test_embedders_build_off_the_loop_retry_failures_and_keep_a_few():
    now = [0.0]
    calls: list[str] = []

    def build(spec: CacheEmbedder) -> Fixed:
        calls.append(spec.model or "")
        if spec.model == "broken":
            raise OSError("no such model")
        return Fixed(spec.model or "")

    default = CacheEmbedder()
    embedders = Embedders(build, {default: Fixed("default")}, retry_s=5.0, keep=2, clock=lambda: now[0])
    assert embedders(default).identity == "default" and calls == []
    one, two, broken = CacheEmbedder(model="one"), CacheEmbedder(model="two"), CacheEmbedder(model="broken")
    assert embedders(one) is None  # building: the caller matches exactly meanwhile
    assert (await embedders.ready(one)).identity == "one"
    assert await embedders.ready(broken) is None and calls == ["one", "broken"]
    assert embedders(broken) is None
    await asyncio.sleep(0)
    assert calls == ["one", "broken"]  # not again before retry_s
    now[0] = 6.0
    assert await embedders.ready(broken) is None and calls == ["one", "broken", "broken"]
    first = embedders(default)
    assert (await embedders.ready(two)).identity == "two"
    assert first.closed and embedders(default) is None  # only the last two built are kept
    await embedders.close()


def test_the_verifier_reads_only_a_yes_and_needs_an_endpoint():
    from llmesh.liveconfig.schema import CacheVerifier
    from llmesh.cache.verifier import messages, verdict
    assert verdict('{"same": "yes"}') and verdict("Yes.") and verdict(" yes\n")
    for no in ('{"same": "no"}', "no", "", "yes, but", '{"same": true}', "[1]", "maybe"):
        assert not verdict(no), no
    assert "Stored question: a\nNew question: b" in messages("a", "b")[-1]["content"]
    assert not CacheVerifier().enabled
    for bad in ({"enabled": True}, {"enabled": True, "base_url": "https://x/v1"},
                {"enabled": True, "base_url": "http://example.com/v1", "model": "m"},
                {"candidate_threshold": 0}, {"max_candidates": 0}):
        with pytest.raises(ValidationError):
            CacheVerifier.model_validate(bad)


def test_a_local_models_identity_is_its_name_and_weights(minilm_dir, minilm):
    named = build_embedder(CacheEmbedder(model=minilm_dir.name), minilm_dir, EmbedderSecrets())
    assert named.identity == minilm.identity  # the same model named explicitly: the same scopes
    name, digest = minilm.identity.rsplit(":", 1)
    assert name == f"local:{minilm_dir.name}" and len(digest) == 16

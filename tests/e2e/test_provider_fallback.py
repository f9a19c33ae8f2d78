"""Fallback to an external OpenAI-compatible provider when no engine can serve the
model, through the real gateway with the official openai client. The provider is a
local OpenAI-compatible server (bench.instant_openai) in its own process."""

from __future__ import annotations

import json

import pytest

from bench import instant_openai

CHUNKS = 8
EXPECTED = "".join(f" w{i}" for i in range(CHUNKS))


@pytest.fixture
def provider_config(live_config):
    with instant_openai.running(CHUNKS) as base_url:
        live_config(json.dumps({
            "default": {"max_attempts": 2},
            "models": {"unserved-model": {"fallbacks": ["hosted"]}},
            "providers": {"local": {"base_url": base_url, "models": {"hosted": "instant"}}},
        }))
        yield


def test_no_engine_falls_back_to_the_provider(client, provider_config):
    raw = client.chat.completions.with_raw_response.create(
        model="unserved-model", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    resp = raw.parse()
    assert raw.headers["x-llmesh-fallback"] == "hosted"
    assert resp.choices[0].message.content == EXPECTED
    assert resp.usage.completion_tokens == CHUNKS
    chunks = list(client.chat.completions.create(model="unserved-model", stream=True, max_tokens=8,
                                                 messages=[{"role": "user", "content": "hi"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == EXPECTED
    assert chunks[-1].choices[0].finish_reason == "length"

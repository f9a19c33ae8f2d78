"""The verifier's judge over HTTP: a constrained yes/no question to a model behind an
OpenAI-compatible ``/v1/chat/completions`` (llmesh's own gateway, or a provider). The answer is
held to a JSON schema (``{"same": "yes" | "no"}``, which llmesh's engines enforce with a grammar);
a plain "yes"/"no" is read too, anything else is a no. The questions are never logged."""

from __future__ import annotations

import orjson
import httpx

from llmesh.liveconfig.schema import CacheVerifier
from llmesh.cache.embedders import EmbedderSecrets

INSTRUCTION = (
    "You decide whether a cached answer may be reused. The stored question was answered; a user now asks "
    "the new question. Reply yes only if the stored answer answers the new question exactly as well: the "
    "same intent, facts, numbers, units, names, scope, time and polarity (a negation or an opposite changes "
    "the answer). Wording, spelling, politeness and length do not matter. Otherwise reply no.")
SCHEMA = {"type": "object", "properties": {"same": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["same"], "additionalProperties": False}


def messages(stored: str, asked: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": INSTRUCTION},
            {"role": "user", "content": f"Stored question: {stored}\nNew question: {asked}\nSame answer?"}]


def verdict(text: str) -> bool:
    """The judge's reply read as yes (True) or anything else (False)."""
    text = text.strip()
    try:
        doc = orjson.loads(text)
        if isinstance(doc, dict):
            text = str(doc.get("same", ""))
    except orjson.JSONDecodeError:
        pass
    return text.strip().strip('."').lower() in ("yes", "是")


class HttpJudge:
    """One client per (endpoint, key): connections are kept between judgements."""

    def __init__(self, secrets: EmbedderSecrets):
        self._secrets = secrets
        self._clients: dict[tuple[str, str | None], httpx.AsyncClient] = {}

    def _client(self, verifier: CacheVerifier) -> httpx.AsyncClient:
        assert verifier.base_url is not None  # the schema's rule for an enabled verifier
        key = self._secrets.api_key(verifier)
        client = self._clients.get((verifier.base_url, key))
        if client is None:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            client = httpx.AsyncClient(base_url=verifier.base_url.rstrip("/"), headers=headers)
            self._clients[(verifier.base_url, key)] = client
        return client

    async def __call__(self, verifier: CacheVerifier, stored: str, asked: str) -> bool:
        body = {"model": verifier.model, "messages": messages(stored, asked), "temperature": 0, "max_tokens": 16,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "verdict", "strict": True, "schema": SCHEMA}}}
        resp = await self._client(verifier).post("/chat/completions", json=body, timeout=verifier.timeout_s)
        resp.raise_for_status()
        return verdict(resp.json()["choices"][0]["message"]["content"] or "")

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

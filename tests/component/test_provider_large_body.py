"""A prompt larger than one piece of ``json_pieces`` reaches an external provider as the JSON a
small one would be, sent as its pieces under their total Content-Length: the provider client
against a recording provider on loopback."""

from __future__ import annotations

import orjson

from llmesh.liveconfig.schema import Provider
from llmesh.types import Message, Prompt
from llmesh.gateway.upstream import json_pieces
from llmesh.gateway.upstream.providers import ProviderClients, request_body
from tests.component.helpers import completion_request, recording_provider


async def test_a_large_prompt_reaches_the_provider_as_its_json(monkeypatch):
    pieces: list[int] = []
    real = json_pieces.pieces

    async def counted(obj, piece=json_pieces.PIECE_CHARS):
        pieces.append(piece)
        return await real(obj, piece)

    monkeypatch.setattr(json_pieces, "pieces", counted)
    unit = 'say "hi"\n\u2028中 '
    text = unit * (json_pieces.PIECE_CHARS // len(unit) + 1)  # over one piece (escapes, non-ASCII), under 1 MiB
    req = completion_request("hosted", prompt=Prompt(messages=(Message("system", "brief"), Message("user", text))),
                             timeout_s=30, max_tokens=4)
    async with recording_provider() as (fake, base_url):
        clients = ProviderClients(proxies={})
        provider = Provider(base_url=base_url, models={"hosted": "their-model"})
        try:
            items = [item async for item in clients.generate(provider, "their-model", req, 30)]
        finally:
            await clients.close()
    assert items[0].text == "ok" and pieces == [json_pieces.PIECE_CHARS]
    [raw] = fake.bodies
    assert fake.framing == [(str(len(raw)), None)]  # its length up front, not chunked
    assert raw == orjson.dumps(request_body(req, "their-model")[1])
    assert orjson.loads(raw)["messages"][1]["content"] == text

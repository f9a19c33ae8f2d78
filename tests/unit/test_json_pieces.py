"""The provider body's piecewise JSON (``json_pieces``): byte for byte what ``orjson.dumps`` gives,
whatever the value and however small the pieces, and the event loop runs other tasks between
pieces of a long text; ``providers.encoded`` takes that way only for a large prompt."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmesh.types import Message, Prompt, Sampling, ToolCall
from llmesh.gateway.context import CompletionRequest
from llmesh.gateway.upstream import json_pieces
from llmesh.gateway.upstream.json_pieces import dumps
from llmesh.gateway.upstream.providers import encoded, request_body

TEXT = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(['\\"\x00\u2028\ud7ff', "é中", ""])
SCALARS = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
           | st.floats(allow_nan=False, allow_infinity=False) | TEXT)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=5)
                      | st.tuples(inner, inner), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(VALUES, st.integers(1, 8))
def test_the_pieces_are_what_orjson_gives(value, piece):
    assert asyncio.run(dumps(value, piece)) == orjson.dumps(value)


def test_what_orjson_refuses_is_refused():
    with pytest.raises(TypeError):
        asyncio.run(dumps({1: "a"}))
    with pytest.raises(TypeError):
        asyncio.run(dumps({"a": "\ud800"}))  # a lone surrogate


@pytest.mark.parametrize("body", [{"messages": [{"content": "x" * 100}]},  # one long text
                                  {"messages": [{"content": "x" * 5}] * 20}])  # many short ones
async def test_other_tasks_run_between_pieces(body):
    finished = False
    seen: list[bool] = []

    async def other() -> None:
        seen.append(finished)

    task = asyncio.create_task(other())  # it runs at the first point where dumps lets the loop go
    data = await dumps(body, piece=10)
    finished = True
    await task
    assert seen == [False] and data == orjson.dumps(body)


async def test_a_large_prompt_is_encoded_in_pieces_a_small_one_at_once(monkeypatch):
    calls: list[int] = []
    real = json_pieces.pieces

    async def counted(obj, piece=json_pieces.PIECE_CHARS):
        calls.append(piece)
        return await real(obj, piece)

    def joined(data):
        return data if isinstance(data, bytes) else b"".join(data)

    monkeypatch.setattr(json_pieces, "pieces", counted)
    monkeypatch.setattr(json_pieces, "PIECE_CHARS", 64)
    call = ToolCall(0, "c1", "f", '{"a": "' + "\u2028" * 40 + '"}')
    for messages, pieces in (((Message("user", "hi"),), 0), ((Message("user", "x" * 65),), 1),
                             ((Message("user", "x" * 30), Message("assistant", "", tool_calls=(call,))), 1)):
        req = CompletionRequest("r", "t", "ours", Prompt(messages=messages), Sampling(max_tokens=3), 5.0)
        calls.clear()
        body = request_body(req, "theirs")[1]
        assert joined(await encoded(body, req)) == orjson.dumps(body)
        assert len(calls) == pieces
    text = CompletionRequest("r", "t", "ours", Prompt(text="y" * 65), Sampling(), 5.0)
    calls.clear()
    assert joined(await encoded(request_body(text, "theirs")[1], text)) == orjson.dumps(request_body(text, "theirs")[1])
    assert len(calls) == 1


async def test_pieces_are_posted_in_writes_of_about_write_bytes_joined_to_the_body():
    from llmesh.gateway.upstream.providers import WRITE_BYTES, posted
    pieces = [b"x" * 10] * 60_000 + [b"y" * (WRITE_BYTES * 2)] + [b"z"]
    stream, headers = posted(pieces, {"content-type": "application/json"})
    writes = [w async for w in stream]
    assert b"".join(writes) == b"".join(pieces) and headers["content-length"] == str(len(b"".join(pieces)))
    assert len(writes) <= len(b"".join(pieces)) // WRITE_BYTES + 2 and all(writes)

"""The HTTP fronts' body reader against the ASGI receive messages a server sends: with and without
a Content-Length, a body shorter than declared, and bodies over the limit, declared or not."""

import asyncio
import tracemalloc

import pytest

from llmesh.errors import InvalidArgument
from llmesh.gateway.fronts.http import MAX_BODY, _too_large
from llmesh.gateway.fronts.reading import OFF_LOOP_BYTES, declared_length, read_body


def _receive(pieces: list[bytes]):
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]
    queue = iter(messages)

    async def receive() -> dict:
        return next(queue)
    return receive


def _read(pieces: list[bytes], declared: int | None) -> bytes:
    return asyncio.run(read_body(_receive(pieces), declared, MAX_BODY, _too_large))


@pytest.mark.parametrize("declared", [None, 11, 64], ids=["chunked", "exact", "shorter-than-declared"])
def test_the_body_is_its_pieces_in_order(declared):
    body = _read([b"hello", b" ", b"", b"world"], declared)
    assert bytes(body) == b"hello world"


def test_more_than_declared_is_kept_whole():
    assert bytes(_read([b"abc", b"def"], 4)) == b"abcdef"


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    async def never() -> dict:
        raise AssertionError("read a body it had to refuse")
    with pytest.raises(InvalidArgument, match="larger than"):
        asyncio.run(read_body(never, MAX_BODY + 1, MAX_BODY, _too_large))


def test_a_chunked_body_past_the_limit_is_refused():
    piece = b"x" * (1 << 20)
    with pytest.raises(InvalidArgument, match="larger than"):
        _read([piece] * 17, None)


@pytest.mark.parametrize("value,expected", [("12", 12), ("", None), ("-1", None), ("1e3", None), ("0", 0)])
def test_declared_length(value, expected):
    assert declared_length({"content-length": value} if value else {}) == expected


def test_a_declared_length_is_not_trusted_with_memory():
    """A client that declares the limit and sends two bytes makes the reader hold what it sent, not the limit."""
    tracemalloc.start()
    try:
        body = _read([b"x", b"x"], MAX_BODY)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert body == b"xx" and peak < 64 * 1024


@pytest.mark.parametrize("declared", [None, 40 * 65536], ids=["chunked", "declared"])
def test_a_large_body_is_joined_whole_in_a_thread(declared, monkeypatch):
    """Past OFF_LOOP_BYTES the pieces are joined off the event loop (bytes.join copies without the
    GIL there); below it, on the loop. The body is the same either way."""
    joined_in: list[str] = []
    to_thread = asyncio.to_thread

    async def spy(fn, *args):
        joined_in.append("thread")
        return await to_thread(fn, *args)
    monkeypatch.setattr(asyncio, "to_thread", spy)
    piece = b"y" * 65536
    n = 40  # 2.5 MiB
    assert n * len(piece) >= OFF_LOOP_BYTES
    assert _read([piece] * n, declared) == piece * n and joined_in == ["thread"]
    assert _read([piece] * 2, None) == piece * 2 and joined_in == ["thread"]  # 128 KiB: on the loop

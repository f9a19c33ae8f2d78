"""The HTTP fronts' body reader against the ASGI receive messages a server sends: with and without
a Content-Length, a body shorter than declared, and bodies over the limit, declared or not."""

import asyncio
import tracemalloc

import pytest

from llmesh.errors import InvalidArgument
from llmesh.gateway.fronts.http import MAX_BODY, _too_large
from llmesh.gateway.fronts.reading import FIRST_BYTES, declared_length, read_body


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
    """A client that declares the limit and sends two bytes makes the reader hold a small buffer, not the limit."""
    tracemalloc.start()
    try:
        body = _read([b"x", b"x"], MAX_BODY)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert bytes(body) == b"xx" and peak < 2 * FIRST_BYTES < MAX_BODY


def test_a_large_body_grows_by_doubling_to_its_declared_length():
    piece = b"y" * 65536
    n = 40  # 2.5 MiB, past the first buffer
    body = _read([piece] * n, len(piece) * n)
    assert bytes(body) == piece * n

"""Reading an HTTP request body on ASGI within a cap. Shared by the HTTP front's routes
(``http``: completions and embeddings; ``batches``: uploads and batch creation)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from llmesh.errors import LlmeshError
from llmesh.gateway.fronts.responses import Receive


def declared_length(headers: dict[str, str]) -> int | None:
    """The body's Content-Length, or None (chunked, or not a number: the server frames the body)."""
    value = headers.get("content-length", "")
    return int(value) if value.isdigit() else None


FIRST_BYTES = 1 << 20  # the buffer's first size at most: a declared length is a client's claim


async def read_body(receive: Receive, declared: int | None, cap: int,
                    too_large: Callable[[], LlmeshError]) -> bytearray:
    """The whole body, copied piece by piece into one buffer as it arrives, so that no step on the
    event loop is a copy of the whole body (joining a list of pieces at the end was one 20-80 ms
    copy for 16 MiB here). The buffer holds what arrived: it starts at ``FIRST_BYTES`` (or the
    declared length, if smaller) and doubles, up to the declared length, as the bytes come, so a
    client that declares 16 MiB and sends nothing costs no more than one that declares nothing. A
    body over ``cap`` raises ``too_large()``: at once when its length says so, else as soon as it
    passes the cap, never holding more."""
    if declared is not None and declared > cap:
        raise too_large()
    body = bytearray(min(declared if declared is not None else FIRST_BYTES, FIRST_BYTES))
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError
        chunk = message.get("body", b"")
        end = size + len(chunk)
        if end > cap:
            raise too_large()
        if end > len(body):  # double it, not past the declared length unless more came (the server cuts that)
            room = max(end, 2 * len(body))
            grown = bytearray(min(room, declared) if declared is not None and end <= declared else room)
            grown[:size] = memoryview(body)[:size]
            body = grown
        body[size:end] = chunk
        size = end
        if not message.get("more_body"):
            del body[size:]  # the buffer's room past the body (none when the length was declared and kept)
            return body

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


OFF_LOOP_BYTES = 1 << 20  # a body at least this large is joined in a thread


async def read_body(receive: Receive, declared: int | None, cap: int,
                    too_large: Callable[[], LlmeshError]) -> bytes:
    """The whole body: its pieces kept as they arrive, joined once at the end; a body of
    ``OFF_LOOP_BYTES`` or more is joined in a thread, where ``bytes.join`` copies without the GIL
    (past 1 MiB; the new buffer's pages fault in there too), so no step on the event loop copies a
    large body (copying it piece by piece into a growing buffer on the loop held it 70 ms for
    12 MiB in bench.hostile on this busy machine; joining there, 20-80 ms for 16 MiB). What is
    held is what arrived, whatever length the client declared. A body over ``cap`` raises
    ``too_large()``: at once when its length says so, else as soon as it passes the cap, never
    holding more."""
    if declared is not None and declared > cap:
        raise too_large()
    pieces: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            raise too_large()
        if chunk:
            pieces.append(chunk)
        if not message.get("more_body"):
            if size < OFF_LOOP_BYTES:
                return b"".join(pieces)
            return await asyncio.to_thread(b"".join, pieces)

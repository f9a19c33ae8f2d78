"""Writing an HTTP answer on ASGI: a body whole, JSON, or a domain error in OpenAI's error
shape with its status code. Shared by the HTTP front's routes (``http``, ``batches``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson

from llmesh.errors import ErrorCode, LlmeshError
from llmesh.gateway.fronts.openai_api import error_json

HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400, ErrorCode.NOT_FOUND: 404, ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.UNAVAILABLE: 503, ErrorCode.DEADLINE_EXCEEDED: 504, ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500, ErrorCode.UNAUTHENTICATED: 401, ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.FAILED_PRECONDITION: 400,
}
REQUEST_ID = "x-request-id"

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]


def encode_headers(extra: dict[str, str] | None) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in extra.items()] if extra else []


async def respond(send: Send, status: int, body: bytes, content_type: bytes, rid: str | None,
                  extra: dict[str, str] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
               *encode_headers(extra)]
    if rid:
        headers.append((REQUEST_ID.encode(), rid.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def respond_json(send: Send, obj: dict, status: int = 200, rid: str | None = None,
                       extra: dict[str, str] | None = None) -> None:
    await respond(send, status, orjson.dumps(obj), b"application/json", rid, extra)


async def respond_error(send: Send, exc: LlmeshError, rid: str | None) -> None:
    status = HTTP_STATUS[exc.code]
    await respond_json(send, error_json(status, exc.message, exc.reason, exc.param), status, rid, exc.headers)

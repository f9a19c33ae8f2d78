"""The Batch API on the HTTP front: ``/v1/files`` and ``/v1/batches``, OpenAI's shapes.
Thin: authenticate, read the body within its cap and time, call ``BatchService``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from llmesh.errors import BodyTimeout, InvalidArgument, LlmeshError, NotFound
from llmesh.gateway.context import Caller
from llmesh.gateway.domain.batches.service import BatchService
from llmesh.gateway.fronts.multipart import parts
from llmesh.gateway.fronts.reading import declared_length, read_body
from llmesh.gateway.fronts.responses import Receive, Send, respond, respond_error, respond_json
MAX_JSON = 64 << 10  # POST /v1/batches
MULTIPART_SLACK = 64 << 10  # the form's other parts and headers, past the file's cap


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None


def unstreamed(body: bytes) -> bytes:
    """A line's request body, never streamed (a batch takes each answer whole)."""
    obj = orjson.loads(body)
    obj.pop("stream", None)
    obj.pop("stream_options", None)
    return orjson.dumps(obj)


def _query(scope: dict) -> tuple[str | None, int | None]:
    q = parse_qs(scope.get("query_string", b"").decode("latin-1")[:2048])
    after = q.get("after", [None])[0]
    raw = q.get("limit", [None])[0]
    try:
        return after, int(raw) if raw is not None else None
    except ValueError:
        raise InvalidArgument("'limit' must be an integer.", param="limit") from None


class BatchFront:
    """Routes under /v1/files and /v1/batches to ``service``; ``authenticate`` turns the
    bearer credential into the caller (401 as for any request)."""

    def __init__(self, service: BatchService, authenticate: Callable[[str | None], Awaitable[Caller]],
                 body_timeout_s: float):
        self._service = service
        self._authenticate = authenticate
        self._body_timeout = body_timeout_s

    @staticmethod
    def serves(path: str) -> bool:
        return path in ("/v1/files", "/v1/batches") or path.startswith(("/v1/files/", "/v1/batches/"))

    async def app(self, scope: dict, receive: Receive, send: Send,
                  bearer: Callable[[dict[str, str]], str | None]) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            status, answer = await self.handle(scope, receive, bearer(headers))
        except LlmeshError as exc:
            return await respond_error(send, exc, None)
        if isinstance(answer, bytes):
            return await respond(send, status, answer, b"application/jsonl", None)
        await respond_json(send, answer, status)

    async def handle(self, scope: dict, receive: Receive, credential: str | None) -> tuple[int, Any]:
        """(status, JSON object, or bytes for a file's content); raises LlmeshError."""
        caller = await self._authenticate(credential)
        method, path = scope["method"], scope["path"].rstrip("/").split("/")[2:]  # ["files", id, "content"]
        s = self._service
        if path == ["files"]:
            if method == "POST":
                return 200, await self._upload(scope, receive, caller)
            if method == "GET":
                return 200, await s.files(caller, *_query(scope))
        elif path[0] == "files" and len(path) == 2:
            if method == "GET":
                return 200, await s.file(caller, path[1])
            if method == "DELETE":
                return 200, await s.delete_file(caller, path[1])
        elif path[0] == "files" and len(path) == 3 and path[2] == "content" and method == "GET":
            return 200, await s.content(caller, path[1])
        elif path == ["batches"]:
            if method == "POST":
                body = await self._json(scope, receive)
                return 200, await s.create_batch(caller, body.input_file_id, body.endpoint, body.completion_window,
                                                 body.metadata)
            if method == "GET":
                return 200, await s.batches(caller, *_query(scope))
        elif path[0] == "batches" and len(path) == 2 and method == "GET":
            return 200, await s.batch(caller, path[1])
        elif path[0] == "batches" and len(path) == 3 and path[2] == "cancel" and method == "POST":
            return 200, await s.cancel(caller, path[1])
        raise NotFound(f"No route {scope['method']} {scope['path'][:256]}.", reason="not_found")

    async def _read(self, scope: dict, receive: Receive, cap: int, what: str) -> bytes:
        def too_large() -> InvalidArgument:
            return InvalidArgument(f"{what} is larger than {cap} bytes.", reason="file_too_large", param="file")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            async with asyncio.timeout(self._body_timeout):
                return await read_body(receive, declared_length(headers), cap, too_large)
        except TimeoutError:
            raise BodyTimeout(f"The request body did not arrive within {self._body_timeout:g} s.") from None

    async def _upload(self, scope: dict, receive: Receive, caller: Caller) -> dict[str, Any]:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        cap = self._service.limits.max_file_bytes
        form = parts(await self._read(scope, receive, cap + MULTIPART_SLACK, "The upload"),
                     headers.get("content-type", ""))
        file, purpose = form.get("file"), form.get("purpose")
        if file is None or purpose is None:
            raise InvalidArgument("The upload needs the fields 'file' and 'purpose'.", param="file")
        return await self._service.create_file(caller, file.filename or "batch.jsonl",
                                               purpose.data.decode("utf-8", "replace").strip(), file.data)

    async def _json(self, scope: dict, receive: Receive) -> CreateBatch:
        raw = await self._read(scope, receive, MAX_JSON, "The request body")
        try:
            return CreateBatch.model_validate(orjson.loads(raw))
        except (orjson.JSONDecodeError, ValidationError) as exc:
            first = exc.errors()[0] if isinstance(exc, ValidationError) else None
            where = ".".join(str(p) for p in first["loc"]) if first else None
            raise InvalidArgument(f"Invalid request body{f': {where}' if where else ''}.", param=where) from None


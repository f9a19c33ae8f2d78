"""OpenAI-compatible HTTP front (Starlette). Thin: parse, run the pipeline, encode."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from llmesh.errors import ErrorCode, LlmeshError
from llmesh.logs import request_id_var
from llmesh.types import Delta, Finish
from llmesh.gateway.openai_api import (CHAT, TEXT, ChatBody, ChunkWriter, CompletionBody, Shape,
                                       completion_json, error_json, parse)
from llmesh.gateway.pipeline import CompletionRequest, Pipeline

HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400, ErrorCode.NOT_FOUND: 404, ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.UNAVAILABLE: 503, ErrorCode.DEADLINE_EXCEEDED: 504, ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500,
}
REQUEST_ID = "x-request-id"
TIMEOUT_HEADERS = ("x-request-timeout", "x-stainless-timeout")  # seconds; the OpenAI SDK sends the latter


def _json(body: dict, status: int = 200, rid: str | None = None) -> Response:
    headers = {REQUEST_ID: rid} if rid else None
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def error_response(exc: LlmeshError, rid: str | None) -> Response:
    status = HTTP_STATUS[exc.code]
    return _json(error_json(status, exc.message, exc.reason, exc.param), status, rid)


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class HttpFront:
    def __init__(self, pipeline: Pipeline, models: Callable[[], list[str]], ready: Callable[[], bool],
                 default_timeout_s: float, tenant: str = "default"):
        self._pipeline = pipeline
        self._models = models
        self._ready = ready
        self._default_timeout = default_timeout_s
        self._tenant = tenant
        self._started = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_error})

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        return _json(error_json(exc.status_code, exc.detail, None, None), exc.status_code)

    def _timeout(self, request: Request) -> float:
        for name in TIMEOUT_HEADERS:
            value = request.headers.get(name)
            if value:
                try:
                    seconds = float(value)
                except ValueError:
                    continue
                if seconds > 0:
                    return min(seconds, self._default_timeout)
        return self._default_timeout

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, ChatBody, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, CompletionBody, TEXT)

    async def _complete(self, request: Request, body_cls, shape: Shape) -> Response:
        rid = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        request_id_var.set(rid)
        try:
            body = parse(body_cls, await request.body())
            prompt = body.prompt() if shape.chat else body.prompt_value()
            req = CompletionRequest(request_id=rid, tenant=self._tenant, model=body.model, prompt=prompt,
                                    sampling=body.sampling_params(), timeout_s=self._timeout(request),
                                    user=body.user, trace_headers=request.headers,
                                    operation="chat" if shape.chat else "text_completion")
            items = self._pipeline.run(req)
            if body.stream:
                # Wait for the first item so an early failure still gets its status code.
                first = await anext(items)
                writer = ChunkWriter(shape, rid, body.model, body.include_usage)
                return StreamingResponse(self._events(writer, first, items), media_type="text/event-stream",
                                         headers={REQUEST_ID: rid, "cache-control": "no-cache"})
            async with aclosing(items):
                parts, finish = [], None
                async for item in items:
                    if isinstance(item, Delta):
                        parts.append(item.text)
                    else:
                        finish = item
            return _json(completion_json(shape, rid, body.model, "".join(parts), finish.reason, finish.usage),
                         rid=rid)
        except LlmeshError as exc:
            return error_response(exc, rid)

    async def _events(self, writer: ChunkWriter, first: Delta | Finish,
                      items: AsyncIterator[Delta | Finish]) -> AsyncIterator[bytes]:
        async with aclosing(items):
            try:
                # The role chunk rides with the first text: one write before the first token.
                role = writer.role()
                head = _sse(role) if role is not None else b""
                item = first
                while True:
                    if isinstance(item, Delta):
                        if item.text:
                            yield head + _sse(writer.delta(item.text))
                            head = b""
                    else:
                        usage = writer.usage(item.usage)
                        yield head + _sse(writer.finish(item.reason)) + (_sse(usage) if usage is not None else b"")
                        break
                    item = await anext(items)
            except LlmeshError as exc:
                # Headers are gone; OpenAI's convention is an error object in the stream.
                yield _sse(error_json(HTTP_STATUS[exc.code], exc.message, exc.reason, exc.param))
            yield b"data: [DONE]\n\n"

    async def list_models(self, request: Request) -> Response:
        data = [{"id": name, "object": "model", "created": self._started, "owned_by": "llmesh"}
                for name in self._models()]
        return _json({"object": "list", "data": data})

    async def healthz(self, request: Request) -> Response:
        ready = self._ready()
        return _json({"status": "ok" if ready else "starting"}, 200 if ready else 503)

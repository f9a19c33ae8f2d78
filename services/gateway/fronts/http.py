"""OpenAI-compatible HTTP front: a plain ASGI app (served by uvicorn). Thin: parse,
run the pipeline, encode.

Four routes do not need a framework, and the request path is where a gateway's CPU
goes. Replacing Starlette (its middleware stack and a task group per streamed
response showed as ~15% of the gateway's samples in py-spy, twice our pipeline)
took a /healthz round trip from 1.54 to 1.14 ms and the added TTFT of a streamed
request at one stream from 4.95 to 4.17 ms (bench/gateway.py, same machine)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, cast

import orjson

from llmesh.errors import BodyTimeout, Internal, InvalidArgument, LlmeshError, NestedTooDeep
from llmesh.logs import request_id_var
from llmesh.request_id import accept
from llmesh.types import Delta, Finish, Priority, TokenLogprob
from llmesh.gateway.domain.batches.model import Batch
from llmesh.gateway.domain.batches.queue import Work
from llmesh.gateway.fronts.batches import BatchFront, unstreamed
from llmesh.gateway.fronts.body import BodyReader, Parsed
from llmesh.gateway.fronts.choices import ChoiceItems, UsageSum, choice_requests, merge
from llmesh.gateway.fronts.embeddings import (EmbeddingsBody, EmbeddingsCall, embeddings_json, embeddings_request,
                                              read_embeddings)
from llmesh.gateway.fronts.reading import declared_length, read_body
from llmesh.gateway.fronts.openai_api import (CHAT, TEXT, Body, ChatBody, Choice, ChunkWriter, CompletionBody, Shape,
                                              ToolCalls, completion_json, error_json, sse)
from llmesh.gateway.fronts.responses import HTTP_STATUS, REQUEST_ID, Receive, Send
from llmesh.gateway.fronts.responses import encode_headers as _encode
from llmesh.gateway.fronts.responses import respond as _respond
from llmesh.gateway.fronts.responses import respond_error as _error
from llmesh.gateway.fronts.responses import respond_json as _json
from llmesh.gateway.context import Caller, CompletionRequest, Context, Vectors
from llmesh.gateway.domain.listing import ListedModel
from llmesh.gateway.pipeline import Pipeline

log = logging.getLogger("llmesh.gateway.http")

TIMEOUT_HEADERS = ("x-request-timeout", "x-stainless-timeout")  # seconds; the OpenAI SDK sends the latter
MAX_BODY = 16 << 20


def _nested_too_deep() -> NestedTooDeep:
    """A RecursionError's answer: the client's nesting, not a bug (400, no traceback)."""
    log.warning("request nested too deeply")
    return NestedTooDeep()


def bearer(headers: dict[str, str]) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _too_large() -> InvalidArgument:
    return InvalidArgument(f"The request body is larger than {MAX_BODY} bytes.")


@contextlib.asynccontextmanager
async def _cancelled_on_disconnect(receive: Receive) -> AsyncIterator[None]:
    """Cancels the work inside when the client goes away (the ASGI server only says so
    on ``receive``), which cancels the pipeline and so the engine call; the CancelledError
    ends here. Streamed or not, before or after the first token."""
    task = cast("asyncio.Task[Any]", asyncio.current_task())  # an ASGI request runs in a task
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


class HttpFront:
    def __init__(self, pipeline: Pipeline, models: Callable[[str | None], Awaitable[list[ListedModel]]],
                 ready: Callable[[], bool], default_timeout_s: float, body_timeout_s: float = 30.0,
                 bodies: BodyReader | None = None, batches: BatchFront | None = None):
        self._pipeline = pipeline
        self._batches = batches  # /v1/files and /v1/batches
        self._bodies = bodies or BodyReader()  # a large body is parsed off the event loop when it has workers
        self._models = models  # the models a credential may use
        self._ready = ready
        self._default_timeout = default_timeout_s
        self._body_timeout = body_timeout_s
        self._started = int(time.time())
        self._routes = {
            "/v1/chat/completions": ("POST", lambda scope, receive, send:
                                     self._complete(scope, receive, send, ChatBody, CHAT)),
            "/v1/completions": ("POST", lambda scope, receive, send:
                                self._complete(scope, receive, send, CompletionBody, TEXT)),
            "/v1/embeddings": ("POST", self._embeddings),
            "/v1/models": ("GET", self.list_models),
            "/healthz": ("GET", self.healthz),
        }

    async def app(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        route = self._routes.get(scope["path"].rstrip("/") or "/")
        if route is None and self._batches is not None and self._batches.serves(scope["path"]):
            return await self._batches.app(scope, receive, send, bearer)
        if route is None:
            return await _json(send, error_json(404, f"No route {scope['path']}.", "not_found", None), 404)
        method, handler = route
        if scope["method"] != method:
            return await _json(send, error_json(405, f"Use {method} for {scope['path']}.", "method_not_allowed",
                                                None), 405)
        await handler(scope, receive, send)

    def _timeout(self, headers: dict[str, str]) -> float:
        for name in TIMEOUT_HEADERS:
            value = headers.get(name)
            if value:
                try:
                    seconds = float(value)
                except ValueError:
                    continue
                if seconds > 0:
                    return min(seconds, self._default_timeout)
        return self._default_timeout

    async def _complete(self, scope: dict, receive: Receive, send: Send, body_cls: type[Body], shape: Shape
                        ) -> None:
        async def answer(rid: str, headers: dict[str, str], body: Parsed, client_rid: str | None) -> None:
            await self._answer(send, rid, headers, body, shape, client_rid)
        await self._handle(scope, receive, send, "chat" if shape.chat else "text_completion",
                           lambda raw: self._bodies.read(body_cls, raw), answer)

    async def _embeddings(self, scope: dict, receive: Receive, send: Send) -> None:
        async def parse(raw: bytes) -> EmbeddingsCall:
            return await self._bodies.parse(read_embeddings, EmbeddingsBody, raw)

        async def answer(rid: str, headers: dict[str, str], call: EmbeddingsCall, client_rid: str | None) -> None:
            await self._embed(send, rid, headers, call, client_rid)
        await self._handle(scope, receive, send, "embeddings", parse, answer)

    async def _handle(self, scope: dict, receive: Receive, send: Send, operation: str,
                      parse: Callable[[bytes], Awaitable[Any]], answer: Callable[..., Awaitable[None]]) -> None:
        """A POST's body read (within the body timeout) and parsed, then ``answer``ed; a body
        refused before the pipeline gets its record (``Pipeline.refused``) and its error."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        rid, client_rid = accept(headers.get(REQUEST_ID))  # an unsafe or overlong id is replaced
        request_id_var.set(rid)
        started = time.monotonic()
        unread = CompletionRequest.unread(rid, operation, client_rid)
        try:
            async with asyncio.timeout(self._body_timeout):
                raw = await read_body(receive, declared_length(headers), MAX_BODY, _too_large)
        except TimeoutError:
            message = f"The request body did not arrive within {self._body_timeout:g} s."
            self._pipeline.refused(unread, BodyTimeout(message), started)
            return await _json(send, error_json(408, message, "request_timeout", None), 408, rid,
                               {"connection": "close"})
        except LlmeshError as exc:
            self._pipeline.refused(unread, exc, started)
            return await _error(send, exc, rid)
        async with _cancelled_on_disconnect(receive):
            try:
                body = await parse(raw)
            except (LlmeshError, RecursionError) as caught:  # each refused request gets its record too
                err = caught if isinstance(caught, LlmeshError) else _nested_too_deep()
                self._pipeline.refused(unread, err, started)
                return await _error(send, err, rid)
            await answer(rid, headers, body, client_rid)

    async def _embed(self, send: Send, rid: str, headers: dict[str, str], call: EmbeddingsCall,
                     client_rid: str | None) -> None:
        """One embeddings request through the pipeline: its one item is the vectors."""
        req = embeddings_request(call, rid, self._timeout(headers), trace_headers=headers,
                                 credential=bearer(headers), client_request_id=client_rid)
        ctx = Context.of(req)
        try:
            async with aclosing(self._pipeline.run(req, ctx)) as items:
                async for item in items:
                    if isinstance(item, Vectors):
                        body = embeddings_json(item, call.model, call.encoding_format)
                        return await _respond(send, 200, body, b"application/json", rid, ctx.headers)
            raise Internal("The upstream answered an embeddings request without vectors.")
        except LlmeshError as exc:
            await _error(send, exc, rid)

    async def _answer(self, send: Send, rid: str, headers: dict[str, str], body: Parsed, shape: Shape,
                      client_rid: str | None = None, on_behalf: Caller | None = None) -> None:
        try:
            sampling = body.sampling
            n = body.n
            req = CompletionRequest(request_id=rid, tenant="", model=body.model, prompt=body.prompt,
                                    sampling=sampling, timeout_s=self._timeout(headers),
                                    user=body.user, trace_headers=headers,
                                    operation="chat" if shape.chat else "text_completion",
                                    credential=bearer(headers), tools=body.tools,
                                    stream=body.stream, client_request_id=client_rid, on_behalf=on_behalf,
                                    priority=Priority.LOW if on_behalf is not None else Priority.NORMAL)
            shared: dict | None = {} if n > 1 else None  # the choices' common work (the guards')
            ctxs = [Context.of(r, shared) for r in choice_requests(req, n)]
            items = merge([self._pipeline.run(c.req, c) for c in ctxs])
            want_logprobs = sampling.logprobs is not None
            if body.stream:
                # Wait for the first item so an early failure still gets its status code.
                first = await anext(items)
                writer = ChunkWriter(shape, rid, body.model, body.include_usage, logprobs=want_logprobs)
                return await self._stream(send, rid, writer, first, items, ctxs[0].headers, n)
            texts: list[list[str]] = [[] for _ in range(n)]
            logprobs: list[list[TokenLogprob]] | None = [[] for _ in range(n)] if want_logprobs else None
            finishes: list[Finish | None] = [None] * n  # each run ends in a Finish, or raises
            calls = [ToolCalls() for _ in range(n)] if req.tools is not None else None
            total = UsageSum()
            async with aclosing(items):
                async for i, item in items:
                    if isinstance(item, Delta):
                        texts[i].append(item.text)
                        if logprobs is not None:
                            logprobs[i].extend(item.logprobs)
                        if item.tool_calls and calls is not None:
                            calls[i].add(item.tool_calls)
                    else:
                        finishes[i] = item
                        total.add(item)
            choices = [Choice("".join(texts[i]), cast(Finish, finishes[i]).reason,
                              logprobs[i] if logprobs is not None else None,
                              calls[i].json() if calls is not None else None) for i in range(n)]
            await _json(send, completion_json(shape, rid, body.model, choices, total.usage),
                        rid=rid, extra=ctxs[0].headers)
        except LlmeshError as exc:
            await _error(send, exc, rid)
        except RecursionError:
            await _error(send, _nested_too_deep(), rid)

    async def _stream(self, send: Send, rid: str, writer: ChunkWriter,
                      first: tuple[int, Delta | Finish], items: ChoiceItems,
                      extra: dict[str, str], n: int) -> None:
        """SSE, one write per event batch; a client that goes away cancels the stream
        (_cancelled_on_disconnect)."""
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
            (REQUEST_ID.encode(), rid.encode()), *_encode(extra)]})
        async with aclosing(self._events(writer, first, items, n)) as events:  # closed when a send is cancelled
            async for chunk, more in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": more})

    async def _events(self, writer: ChunkWriter, first: tuple[int, Delta | Finish],
                      items: ChoiceItems, n: int) -> AsyncGenerator[tuple[bytes, bool], None]:
        """(bytes, more): a write per step; the last choice's finish, the usage chunk,
        [DONE] and the end of the body leave in one write (four ASGI sends before)."""
        tail = b""
        async with aclosing(items):
            try:
                # A choice's role chunk rides with its first text: one write before the first token.
                started: set[int] = set()
                finished = 0
                total = UsageSum()
                i, item = first
                while True:
                    if isinstance(item, Finish) or item.text or item.logprobs or item.tool_calls:
                        head = b""
                        if i not in started:
                            started.add(i)
                            role = writer.role(i)
                            head = sse(role) if role is not None else b""
                        if isinstance(item, Delta):
                            yield tail + head + writer.delta_sse(item.text, i, item.logprobs, item.tool_calls), True
                            tail = b""
                        else:
                            total.add(item)
                            finished += 1
                            tail += head + sse(writer.finish(item.reason, i))
                            if finished < n:
                                yield tail, True
                                tail = b""
                            # else: nothing follows but the stream's end, which takes it along
                    nxt = await anext(items, None)
                    if nxt is None:
                        break
                    i, item = nxt
                usage = writer.usage(total.usage)
                if usage is not None:
                    tail += sse(usage)
            except (LlmeshError, RecursionError) as caught:
                # Headers are gone; OpenAI's convention is an error object in the stream.
                exc = caught if isinstance(caught, LlmeshError) else NestedTooDeep()
                tail += sse(error_json(HTTP_STATUS[exc.code], exc.message, exc.reason, exc.param))
            yield tail + b"data: [DONE]\n\n", False

    async def run_line(self, batch: Batch, work: Work, rid: str) -> tuple[int, Any]:
        """A batch line answered as the same POST would be (parse, pipeline, encoding), never
        streamed, as the batch's caller at the lowest priority: (HTTP status, JSON body)."""
        chat = batch.endpoint == "/v1/chat/completions"
        shape, body_cls = (CHAT, ChatBody) if chat else (TEXT, CompletionBody)
        sent: list[dict] = []

        async def capture(message: dict) -> None:
            sent.append(message)
        try:
            body = await self._bodies.read(body_cls, unstreamed(work.body))
        except (LlmeshError, RecursionError) as caught:
            err = caught if isinstance(caught, LlmeshError) else _nested_too_deep()
            self._pipeline.refused(CompletionRequest.unread(rid, "chat" if chat else "text_completion"), err)
            return HTTP_STATUS[err.code], error_json(HTTP_STATUS[err.code], err.message, err.reason, err.param)
        await self._answer(capture, rid, {}, body, shape, on_behalf=batch.caller)
        return sent[0]["status"], orjson.loads(sent[1]["body"])

    async def list_models(self, scope: dict, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            models = await self._models(bearer(headers))
        except LlmeshError as exc:
            return await _error(send, exc, None)
        data = [{"id": m.name, "object": "model", "created": self._started, "owned_by": m.owned_by,
                 "capabilities": [s.value for s in m.serves]} for m in models]
        await _json(send, {"object": "list", "data": data})

    async def healthz(self, scope: dict, receive: Receive, send: Send) -> None:
        ready = self._ready()
        await _json(send, {"status": "ok" if ready else "starting"}, 200 if ready else 503)

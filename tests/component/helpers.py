"""Plain helpers for the component tests that drive the gateway pipeline in process (the
fixtures, such as ``engines``, are in conftest.py): a request factory each test file binds
to its own defaults, a catalog of known models, one way to run a request through (and one
to POST a body through an ASGI app), and a recording stand-in for an external provider."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple

import orjson
from aiohttp import web

from llmesh.engine.core import EngineCore
from llmesh.gateway.context import CompletionRequest, Context
from llmesh.gateway.pipeline import Pipeline
from llmesh.gateway.upstream.picking import Endpoint
from llmesh.testing import free_ports
from llmesh.types import Delta, Finish, Message, Prompt, Sampling, Tools


def free_port() -> int:
    return free_ports(1)[0]


def completion_request(model: str, text: str = "hello there", *, request_id: str = "r", tenant: str = "t",
                       timeout_s: float = 10, system: str | None = None, prompt: Prompt | None = None,
                       stream: bool = True, **sampling) -> CompletionRequest:
    """A chat request for ``model``: one user turn (after a system one if given), or ``prompt``;
    the keyword arguments left are its Sampling."""
    if prompt is None:
        prompt = Prompt(messages=((Message("system", system),) if system else ()) + (Message("user", text),))
    return CompletionRequest(request_id=request_id, tenant=tenant, model=model, timeout_s=timeout_s,
                             stream=stream, prompt=prompt, sampling=Sampling(**sampling))


class Catalog:
    """The models a pipeline knows: the ones named, and every one starting with ``prefix``."""

    def __init__(self, *models: str, prefix: str | None = None):
        self._models = frozenset(models)
        self._prefix = prefix

    def known(self, model: str) -> bool:
        return model in self._models or (self._prefix is not None and model.startswith(self._prefix))

    def names(self) -> list[str]:
        return sorted(self._models)


def dead_endpoint(endpoint_id: str, model: str, port: int | None = None) -> Endpoint:
    """An endpoint at a closed port: an engine that is down."""
    return Endpoint(endpoint_id=endpoint_id, address=f"127.0.0.1:{port or free_port()}", models=frozenset({model}))


class Answer(NamedTuple):
    text: str
    finish: Finish | None
    first_at: float | None  # seconds from the call to the first item
    deltas: list[Delta]


async def generated(core: EngineCore, model: str, prompt: Prompt, sampling: Sampling, continuation: str = ""
                    ) -> tuple[str, list, Finish | None]:
    """An engine core's answer: the text, its log probabilities and the finish (None: none came)."""
    deltas, finish = await answered(core, model, prompt, sampling, continuation)
    return "".join(d.text for d in deltas), [lp for d in deltas for lp in d.logprobs], finish


async def answered(core: EngineCore, model: str, prompt: Prompt, sampling: Sampling, continuation: str = "",
                   tools: Tools | None = None) -> tuple[list[Delta], Finish | None]:
    """An engine core's answer as it came: its Deltas and the finish (None: none came)."""
    deltas, finish = [], None
    async with contextlib.aclosing(core.generate(model, prompt, sampling, continuation=continuation,
                                                 tools=tools)) as items:
        async for item in items:
            if isinstance(item, Delta):
                deltas.append(item)
            else:
                finish = item
    return deltas, finish


async def collect(pipeline: Pipeline, req: CompletionRequest, ctx: Context | None = None) -> Answer:
    """Run ``req`` through ``pipeline`` to its end."""
    deltas, finish, first_at = [], None, None
    started = time.monotonic()
    async for item in pipeline.run(req, ctx):
        first_at = first_at if first_at is not None else time.monotonic() - started
        if isinstance(item, Delta):
            deltas.append(item)
        else:
            finish = item
    return Answer("".join(d.text for d in deltas), finish, first_at, deltas)


async def asgi_post(app: Callable[[dict, Callable, Callable], Awaitable[None]], body: bytes,
                    path: str = "/v1/chat/completions", headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One POST through an ASGI ``app`` (the gateway's HTTP front): its status and its body's bytes.
    The client stays connected until the answer's last byte."""
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []
    done = asyncio.Event()

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-type", b"application/json"),
                         *((k.encode(), v.encode()) for k, v in (headers or {}).items())]}
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


class RecordingProvider:
    """A stand-in for an external OpenAI-compatible API: an aiohttp server on loopback, in
    this process, that answers every chat call with one streamed word and keeps what each
    call carried (its Authorization header, its framing headers and its raw body)."""

    def __init__(self) -> None:
        self.authorizations: list[str | None] = []
        self.framing: list[tuple[str | None, str | None]] = []  # (Content-Length, Transfer-Encoding)
        self.bodies: list[bytes] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.authorizations.append(request.headers.get("authorization"))
        self.framing.append((request.headers.get("content-length"), request.headers.get("transfer-encoding")))
        self.bodies.append(await request.read())
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": "ok"},
                                                                "finish_reason": "stop"}]}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    """``app`` served on a free loopback port (yielded) while the block runs."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def recording_provider() -> AsyncIterator[tuple[RecordingProvider, str]]:
    """A RecordingProvider serving while the block runs, and its base URL (http://127.0.0.1:PORT/v1)."""
    fake = RecordingProvider()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    async with serving(app) as port:
        yield fake, f"http://127.0.0.1:{port}/v1"

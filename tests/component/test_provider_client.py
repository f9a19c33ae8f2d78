"""The provider client's connection behaviour against a real HTTP server (aiohttp's,
in this process, scripted per test): connections are kept and reused, a call's
timeout is its whole deadline, a consumer that stops closes the connection (the
provider sees the client go), cookies are never carried between calls, and an HTTP
proxy from the environment is used."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from functools import partial

import orjson
import pytest
from aiohttp import web

from llmesh.errors import DeadlineExceeded, Unavailable
from llmesh.liveconfig.schema import Provider
from llmesh.testing import free_ports
from llmesh.types import Delta, Finish
from llmesh.gateway.context import CompletionRequest
from llmesh.gateway.upstream.providers import ProviderClients
from tests.component.helpers import completion_request, serving


request = partial(completion_request, "hosted", "hi", timeout_s=30, max_tokens=4)


def chunk(text: str, finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": text},
                                                  "finish_reason": finish}]}) + b"\n\n"


class ScriptedProvider:
    """An OpenAI-compatible endpoint whose answer a test sets: ``stall_after`` chunks then
    silence, or the whole answer. It records each request's connection and headers, and
    whether a stalled stream saw its client go."""

    def __init__(self) -> None:
        self.peers: list[tuple] = []
        self.cookies: list[str | None] = []
        self.paths: list[str] = []
        self.stall_after: int | None = None
        self.client_gone = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.peers.append(request.transport.get_extra_info("peername"))
        self.cookies.append(request.headers.get("cookie"))
        self.paths.append(str(request.url))
        body = await request.json()
        if not body.get("stream"):
            resp = web.json_response({"choices": [{"index": 0, "message": {"content": "whole"},
                                                   "finish_reason": "stop"}],
                                      "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
            resp.set_cookie("session", "tenant-a")
            return resp
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        resp.set_cookie("session", "tenant-a")
        await resp.prepare(request)
        if self.stall_after is not None:
            for i in range(self.stall_after):
                await resp.write(chunk(f" w{i}"))
            try:
                while True:  # the client going away shows as a failed write
                    await asyncio.sleep(0.05)
                    await resp.write(b": keepalive\n\n")
            except (ConnectionResetError, ConnectionError):
                self.client_gone.set()
                raise
        for i in range(3):
            await resp.write(chunk(f" w{i}", "length" if i == 2 else None))
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def provider():
    scripted = ScriptedProvider()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", scripted.handle)
    async with serving(app) as port:
        yield scripted, Provider(base_url=f"http://127.0.0.1:{port}/v1", models={"hosted": "remote"})


async def collect(clients: ProviderClients, p: Provider, req: CompletionRequest, timeout_s: float = 30
                  ) -> tuple[str, Finish]:
    text, finish = "", None
    async for item in clients.generate(p, "remote", req, timeout_s):
        if isinstance(item, Delta):
            text += item.text
        else:
            finish = item
    return text, finish


async def test_connections_are_reused_and_cookies_never_kept(provider):
    scripted, p = provider
    clients = ProviderClients(proxies={})
    try:
        for stream in (True, False, True, False, True):
            text, finish = await collect(clients, p, request(stream=stream))
            assert text == (" w0 w1 w2" if stream else "whole")
            assert finish.reason.value == ("length" if stream else "stop")
        assert len(scripted.peers) == 5 and len(set(scripted.peers)) == 1  # one TCP connection for all
        assert scripted.cookies == [None] * 5  # the provider set one each time; it never came back
    finally:
        await clients.close()


@pytest.mark.parametrize("stall_after", [0, 1])
async def test_the_timeout_is_the_whole_calls_deadline(provider, stall_after):
    """A provider that keeps the connection busy (keepalive comments) but sends no more
    answer is cut at the deadline: no single read waits long, the call as a whole does."""
    scripted, p = provider
    scripted.stall_after = stall_after
    clients = ProviderClients(proxies={})
    try:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await collect(clients, p, request(), timeout_s=0.6)
        assert 0.5 < time.monotonic() - started < 3.0
    finally:
        await clients.close()


async def test_a_consumer_that_stops_closes_the_providers_connection(provider):
    scripted, p = provider
    scripted.stall_after = 1
    clients = ProviderClients(proxies={})
    try:
        async with aclosing(clients.generate(p, "remote", request(), 30)) as items:
            first = await anext(items)
            assert isinstance(first, Delta) and first.text == " w0"
        await asyncio.wait_for(scripted.client_gone.wait(), 5)  # the provider saw the client go
        scripted.stall_after = None
        assert (await collect(clients, p, request()))[0] == " w0 w1 w2"  # a fresh connection serves the next
        assert len(set(scripted.peers)) == 2
    finally:
        await clients.close()


async def test_a_cancelled_call_closes_the_providers_connection(provider):
    """The HTTP front cancels the request's task when its client disconnects."""
    scripted, p = provider
    scripted.stall_after = 1
    clients = ProviderClients(proxies={})
    got_first = asyncio.Event()

    async def consume() -> None:
        async for _ in clients.generate(p, "remote", request(), 30):
            got_first.set()

    try:
        task = asyncio.create_task(consume())
        await asyncio.wait_for(got_first.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(scripted.client_gone.wait(), 5)
    finally:
        await clients.close()


async def test_an_http_proxy_from_the_environment_is_used(provider):
    """HTTP_PROXY names the scripted server; nothing listens at the provider's own address
    (plain http is for loopback only), so an answer can only come through the proxy (which
    gets the absolute URL)."""
    scripted, p = provider
    proxy = p.base_url.removesuffix("/v1")
    hidden_at = f"127.0.0.1:{free_ports(1)[0]}"
    hidden = Provider(base_url=f"http://{hidden_at}/v1", models={"hosted": "remote"})
    clients = ProviderClients(proxies={"http": proxy})
    try:
        assert (await collect(clients, hidden, request(stream=False)))[0] == "whole"
        assert scripted.paths[-1] == f"http://{hidden_at}/v1/chat/completions"
    finally:
        await clients.close()
    bypassed = ProviderClients(proxies={"http": proxy, "no": "127.0.0.1"})
    try:
        with pytest.raises(Unavailable):  # NO_PROXY: straight to an address where nothing listens
            await collect(bypassed, hidden, request(stream=False), timeout_s=10)
    finally:
        await bypassed.close()

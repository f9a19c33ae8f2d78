"""The least a Python HTTP relay can do, for bench.dataplane's fronts: what the gateway's
CPU per request is measured against to tell its own work from the cost of Python's HTTP
stack. The gateway's server stack (uvicorn with httptools on uvloop, a bare ASGI callable)
and its provider client (one aiohttp session, connections kept), and no logic: the body
is passed on as it came and the answer's bytes are passed back as they arrive.

    python -m bench.relay_floor --port 9001 --upstream http://127.0.0.1:9000/v1/chat/completions
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import uvicorn

from llmesh.testing import free_ports, port_open, terminate, wait_until


@contextlib.contextmanager
def running(upstream: str) -> Iterator[tuple[str, int]]:
    """This relay in its own process on a free port while the block runs: its chat
    completions URL and its pid."""
    port = free_ports(1)[0]
    relay = subprocess.Popen([sys.executable, "-m", "bench.relay_floor", "--port", str(port), "--upstream", upstream])
    try:
        assert wait_until(lambda: port_open(port) or relay.poll() is not None, 20) and relay.poll() is None, \
            "the relay did not start"
        yield f"http://127.0.0.1:{port}/v1/chat/completions", relay.pid
    finally:
        terminate(relay, signal.SIGTERM, 10.0)


def app_for(upstream: str):
    session: aiohttp.ClientSession | None = None
    headers = {"content-type": "application/json"}

    async def app(scope, receive, send):
        nonlocal session
        if scope["type"] != "http":
            return
        if session is None:  # an aiohttp session belongs to the running loop
            session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        async with session.post(upstream, data=body, headers=headers) as resp:
            kind = resp.headers.get("content-type", "").encode()
            if kind != b"text/event-stream":  # one body, sent whole
                answer = await resp.read()
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": [(b"content-type", kind), (b"content-length", str(len(answer)).encode())]})
                await send({"type": "http.response.body", "body": answer})
                return
            await send({"type": "http.response.start", "status": resp.status, "headers": [(b"content-type", kind)]})
            async for chunk in resp.content.iter_any():  # each read passed on as it arrives
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the chat completions URL to relay to")
    args = parser.parse_args()
    uvicorn.run(app_for(args.upstream), host="127.0.0.1", port=args.port, loop="uvloop", http="httptools",
                interface="asgi3", lifespan="off", log_level="warning", access_log=False)


if __name__ == "__main__":
    main()

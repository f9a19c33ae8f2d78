"""An OpenAI-compatible server that answers at once, for bench.provider: chat
completions, non-streamed or streamed in ``--chunks`` chunks (the last with usage).

    python -m bench.instant_openai --port 9000 --chunks 32
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import orjson
import uvicorn

from llmesh.testing import free_ports, port_open, terminate, wait_until


@contextlib.contextmanager
def running(chunks: int, nice: int = 0) -> Iterator[str]:
    """This server in its own process on a free port while the block runs: its base URL
    (``http://127.0.0.1:PORT/v1``). ``nice``: its nice value (a provider stands for another
    machine; niced, its CPU here counts less against what the bench measures)."""
    port = free_ports(1)[0]
    server = subprocess.Popen([sys.executable, "-m", "bench.instant_openai", "--port", str(port),
                               "--chunks", str(chunks), "--nice", str(nice)])  # no preexec_fn: llmesh.orphans
    try:
        assert wait_until(lambda: port_open(port), 20), "the instant server did not start"
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        terminate(server, signal.SIGTERM, 10.0)


def app_for(chunks: int):
    words = [f" w{i}" for i in range(chunks)]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        parts = []  # joined once: += on bytes copies the whole body per chunk (quadratic in its size)
        while True:
            msg = await receive()
            parts.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        req = orjson.loads(b"".join(parts) or b"{}")
        model = req.get("model", "instant")
        usage = {"prompt_tokens": 12, "completion_tokens": chunks, "total_tokens": 12 + chunks}
        if not req.get("stream"):
            out = orjson.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": model, "usage": usage,
                                "choices": [{"index": 0, "finish_reason": "length", "logprobs": None,
                                             "message": {"role": "assistant", "content": "".join(words)}}]})
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": out})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": model}
        parts = []
        for i, w in enumerate(words):
            parts.append(b"data: " + orjson.dumps(dict(base, choices=[{
                "index": 0, "delta": {"content": w}, "logprobs": None,
                "finish_reason": "length" if i == chunks - 1 else None}])) + b"\n\n")
        parts.append(b"data: " + orjson.dumps(dict(base, choices=[], usage=usage)) + b"\n\ndata: [DONE]\n\n")
        for p in parts:
            await send({"type": "http.response.body", "body": p, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--nice", type=int, default=0, help="added to this process's nice value")
    args = parser.parse_args()
    if args.nice:
        os.nice(args.nice)
    uvicorn.run(app_for(args.chunks), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()

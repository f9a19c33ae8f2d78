"""Serves a registry's /metrics on its own port, in a thread.

Always in the classic text format: prometheus-client's OpenMetrics output rewrites
``vllm:time_to_first_token_seconds`` into ``vllm_time_to_first_token_seconds`` for
the Prometheus (2.42) here, and vLLM-compatible names are the point of the engine's
metrics. So the scraper's Accept header is not honoured."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from llmesh.ports import DEFAULT_BIND_WAIT_S, bind_retrying
from llmesh.serving import ServingState

HEALTH_PATHS = frozenset({"/healthz", "/readyz"})


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        return None


def _health(state: ServingState, start_response: Callable[..., Any]) -> Iterable[bytes]:
    body = f"{state.status}\n".encode()
    start_response("200 OK" if state.serving else "503 Service Unavailable",
                   [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
                    ("Cache-Control", "no-store")])
    return [body]


def serve_metrics(registry: CollectorRegistry, host: str, port: int,
                  serving: ServingState | None = None) -> WSGIServer:
    """``serving``: the state /healthz and /readyz answer from (without one they are 404)."""
    app = make_wsgi_app(registry)

    def classic_text(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if serving is not None and environ.get("PATH_INFO") in HEALTH_PATHS:
            return _health(serving, start_response)
        environ["HTTP_ACCEPT"] = "text/plain"
        body: Iterable[bytes] = app(environ, start_response)
        return body

    server = make_server(host, port, classic_text, server_class=_Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


async def start_metrics(registry: CollectorRegistry, host: str, port: int,
                        wait_s: float = DEFAULT_BIND_WAIT_S, serving: ServingState | None = None) -> WSGIServer:
    """``serve_metrics``, waiting up to ``wait_s`` for a taken port (llmesh.ports)."""
    return await bind_retrying(lambda: serve_metrics(registry, host, port, serving), f"{host}:{port}",
                               wait_s=wait_s)

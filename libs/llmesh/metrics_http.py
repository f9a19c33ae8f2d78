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


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        return None


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    app = make_wsgi_app(registry)

    def classic_text(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        environ["HTTP_ACCEPT"] = "text/plain"
        body: Iterable[bytes] = app(environ, start_response)
        return body

    server = make_server(host, port, classic_text, server_class=_Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


async def start_metrics(registry: CollectorRegistry, host: str, port: int,
                        wait_s: float = DEFAULT_BIND_WAIT_S) -> WSGIServer:
    """``serve_metrics``, waiting up to ``wait_s`` for a taken port (llmesh.ports)."""
    return await bind_retrying(lambda: serve_metrics(registry, host, port), f"{host}:{port}", wait_s=wait_s)

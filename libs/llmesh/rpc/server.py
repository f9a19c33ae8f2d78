"""grpc.aio server lifecycle shared by every service: health, reflection, the error
interceptor, graceful stop."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import Tracer

from llmesh.ports import DEFAULT_BIND_WAIT_S, bind_retrying, probe, split_address
from llmesh.rpc.identity import Identity
from llmesh.rpc.interceptor import ErrorInterceptor, Unparsed
from llmesh.serving import ServingState

log = logging.getLogger("llmesh.rpc.server")

# Keep streamed tokens moving: no Nagle delay on our sockets, and pings so
# half-dead peers are noticed.
SERVER_OPTIONS = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # Our clients ping every 20 s (rpc.channels), also on a call that sends nothing for a while (a
    # queued request, a non-streamed answer being generated whole): accept that, or after two
    # pings the default (one per 5 min) answers GOAWAY too_many_pings and the channel's calls fail.
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
)


def server_options(reuse_port: bool = False) -> tuple[tuple[str, int], ...]:
    """SERVER_OPTIONS plus SO_REUSEPORT: off (a second server on a taken port fails to
    bind), or on for worker processes that share one port (the kernel spreads connections)."""
    return (*SERVER_OPTIONS, ("grpc.so_reuseport", int(reuse_port)))


@dataclass(frozen=True)
class ServiceBinding:
    """A servicer and the generated function that adds it to a server."""
    name: str  # full proto service name, e.g. "llmesh.v1.Engine"
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    # Told of each call to this service whose request bytes were not its method's message,
    # before the interceptor answers it (INVALID_ARGUMENT): (method, context, the error).
    unparsed: Unparsed | None = None


class GrpcServer:
    def __init__(self, address: str, bindings: Sequence[ServiceBinding], tracer: Tracer | None = None,
                 identity: Identity | None = None, reuse_port: bool = False,
                 bind_wait_s: float = DEFAULT_BIND_WAIT_S, serving: ServingState | None = None):
        """``identity``: the mesh's trust, which decides the port's transport (mutual TLS in "tls"
        trust) and who may call each method (None: anyone, for in-process tests);
        ``reuse_port``: bind with SO_REUSEPORT, beside other processes on the same port;
        ``bind_wait_s``: how long a taken port is tried again (llmesh.ports);
        ``serving``: where the health service's state is also kept, for the metrics port's
        plaintext /healthz (llmesh.metrics_http); the process's ``Platform.serving``."""
        self._address = address
        self._reuse_port = reuse_port
        self._bind_wait_s = bind_wait_s
        self._identity = identity
        self._tracer = tracer
        self._bindings = bindings
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._serving = serving or ServingState()
        self.port: int | None = None

    async def start(self) -> None:
        if self._identity:
            self._identity.check_bind(self._address)
        unparsed = {b.name: b.unparsed for b in self._bindings if b.unparsed is not None}
        server = grpc.aio.server(interceptors=[ErrorInterceptor(self._tracer, self._identity, unparsed)],
                                 options=server_options(self._reuse_port))
        for binding in self._bindings:
            binding.add_to_server(binding.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = [b.name for b in self._bindings] + [
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
        self.port = await bind_retrying(lambda: self._add_port(server), self._address, wait_s=self._bind_wait_s)
        await server.start()
        self._server = server
        await self.set_serving(True)
        log.info("grpc server listening", extra={"address": self.bound_address})

    def _add_port(self, server: grpc.aio.Server) -> int:
        """Binds the server's port; an OSError (EADDRINUSE when the port is taken) if it cannot.
        grpcio raises RuntimeError (1.85) or returns 0 (older) without saying why: a plain
        socket bound with the server's options tells."""
        credentials = self._identity.server_credentials() if self._identity else None
        try:
            port = (server.add_secure_port(self._address, credentials) if credentials
                    else server.add_insecure_port(self._address))
        except RuntimeError as exc:
            failure: Exception = exc
        else:
            if port:
                return port
            failure = RuntimeError(f"grpc returned port 0 for {self._address}")
        try:
            probe(*split_address(self._address), reuse_port=self._reuse_port)
        except ValueError:
            raise OSError(f"cannot bind gRPC server to {self._address}: {failure}") from failure
        # Free now (it was taken a moment ago, or gRPC failed for its own reason): try again.
        raise OSError(errno.EADDRINUSE, f"cannot bind gRPC server to {self._address}: {failure}") from failure

    @property
    def bound_address(self) -> str:
        host = self._address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._health.set("", status)
        for binding in self._bindings:
            await self._health.set(binding.name, status)
        self._serving.set(serving)

    async def stop(self, grace: float) -> None:
        """Stop taking calls, give in-flight ones ``grace`` seconds, then cancel them."""
        if self._server is None:
            return
        await self.set_serving(False)
        await self._server.stop(grace)
        self._server = None

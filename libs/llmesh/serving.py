"""Whether this process serves: one small thread-safe flag that the gRPC health service
(``llmesh.rpc.server.GrpcServer.set_serving``) writes and the plaintext ``/healthz`` of the
metrics port (``llmesh.metrics_http``, a thread) reads, so both always give the same answer."""

from __future__ import annotations

import threading


class ServingState:
    """SERVING or NOT_SERVING; starts NOT_SERVING (nothing serves before its server starts)."""

    def __init__(self, serving: bool = False):
        self._serving = threading.Event()
        if serving:
            self._serving.set()

    def set(self, serving: bool) -> None:
        if serving:
            self._serving.set()
        else:
            self._serving.clear()

    @property
    def serving(self) -> bool:
        return self._serving.is_set()

    @property
    def status(self) -> str:
        """The grpc.health.v1 name of the state: "SERVING" or "NOT_SERVING"."""
        return "SERVING" if self._serving.is_set() else "NOT_SERVING"

"""Whether this process serves: one small thread-safe flag that the gRPC health service
(``llmesh.rpc.server.GrpcServer.set_serving``) writes and the plaintext ``/healthz`` of the
metrics port (``llmesh.metrics_http``, a thread) reads, so both always give the same answer."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

HEARTBEAT_S = 1.0
STALL_S = 10.0  # a loop that has not beaten for this long is not serving, whatever the flag says


class ServingState:
    """SERVING or NOT_SERVING; starts NOT_SERVING (nothing serves before its server starts)."""

    def __init__(self, serving: bool = False, stall_s: float = STALL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._serving = threading.Event()
        if serving:
            self._serving.set()
        self._stall_s = stall_s
        self._clock = clock
        self._beat: float | None = None  # None: no heartbeat runs, the flag alone answers

    def beat(self) -> None:
        """The event loop is alive (``heartbeat`` calls this every second)."""
        self._beat = self._clock()

    async def heartbeat(self, every_s: float = HEARTBEAT_S) -> None:
        """Beats from the serving loop until cancelled, so that /healthz, answered from another
        thread, sees a loop stuck in a blocking call as NOT_SERVING (as a gRPC probe would)."""
        while True:
            self.beat()
            await asyncio.sleep(every_s)

    def set(self, serving: bool) -> None:
        if serving:
            self._serving.set()
        else:
            self._serving.clear()

    @property
    def serving(self) -> bool:
        beat = self._beat
        stalled = beat is not None and self._clock() - beat > self._stall_s
        return self._serving.is_set() and not stalled

    @property
    def status(self) -> str:
        """The grpc.health.v1 name of the state: "SERVING" or "NOT_SERVING"."""
        return "SERVING" if self.serving else "NOT_SERVING"

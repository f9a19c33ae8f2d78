"""An opt-in watch on the gateway's event loop (``LLMESH_GATEWAY_LOOP_WATCH_MS``): a task that
sleeps 10 ms at a time and logs a warning each time it wakes later than the threshold, with the
CPU the loop's thread and the whole process spent meanwhile. Together they tell a busy loop
(the loop's thread spent the time: a callback held it) from a GIL held by another thread of the
process (the process spent it) and from a busy machine (neither did: the process was not
scheduled). A thread beside it samples the loop thread's stack while the loop is late by the
threshold, every quarter of it, so the warning also says where the loop was (its innermost frames
as file:line:function per sample, at most ``SAMPLES``; code locations only, never values).
``bench.hostile`` turns it on and counts the warnings."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

log = logging.getLogger("llmesh.gateway.loop")
TICK_S = 0.01
STACK_DEPTH = 4
SAMPLES = 8


class _StackTaker:
    """Samples the loop thread's stack while its tick is overdue."""

    def __init__(self, loop_thread: int, threshold_s: float) -> None:
        self._thread, self._threshold = loop_thread, threshold_s
        self.due = time.monotonic() + TICK_S
        self.stacks: list[str] = []
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="loop-watch-stack", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self._threshold / 4):
            if time.monotonic() - self.due >= self._threshold and len(self.stacks) < SAMPLES:
                frame = sys._current_frames().get(self._thread)
                if frame is not None:
                    self.stacks.append(" < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}:{f.name}"
                                                  for f in reversed(traceback.extract_stack(frame)[-STACK_DEPTH:])))

    def stop(self) -> None:
        self._stop.set()


async def watch_loop(threshold_s: float) -> None:
    taker = _StackTaker(threading.get_ident(), threshold_s)
    try:
        while True:
            wall, loop_cpu, process_cpu = time.monotonic(), time.thread_time(), time.process_time()
            taker.stacks, taker.due = [], wall + TICK_S
            await asyncio.sleep(TICK_S)
            lag = time.monotonic() - wall - TICK_S
            if lag >= threshold_s:
                log.warning("event loop stalled", extra={
                    "lag_ms": round(lag * 1000, 1),
                    "loop_cpu_ms": round((time.thread_time() - loop_cpu) * 1000, 1),
                    "process_cpu_ms": round((time.process_time() - process_cpu) * 1000, 1),
                    "stacks": taker.stacks})
    finally:
        taker.stop()

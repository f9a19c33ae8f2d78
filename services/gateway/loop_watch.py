"""An opt-in watch on the gateway's event loop (``LLMESH_GATEWAY_LOOP_WATCH_MS``): a task that
sleeps 10 ms at a time and logs a warning each time it wakes later than the threshold, with the
CPU the loop's thread and the whole process spent meanwhile. Together they tell a busy loop
(the loop's thread spent the time: a callback held it) from a GIL held by another thread of the
process (the process spent it) and from a busy machine (neither did: the process was not
scheduled). ``bench.hostile`` turns it on and counts the warnings."""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("llmesh.gateway.loop")
TICK_S = 0.01


async def watch_loop(threshold_s: float) -> None:
    while True:
        wall, loop_cpu, process_cpu = time.monotonic(), time.thread_time(), time.process_time()
        await asyncio.sleep(TICK_S)
        lag = time.monotonic() - wall - TICK_S
        if lag >= threshold_s:
            log.warning("event loop stalled", extra={
                "lag_ms": round(lag * 1000, 1), "loop_cpu_ms": round((time.thread_time() - loop_cpu) * 1000, 1),
                "process_cpu_ms": round((time.process_time() - process_cpu) * 1000, 1)})

"""Where a large prompt's guard work runs: a small pool of worker processes, with a deadline
and a bounded queue, so that no prompt holds the gateway's event loop (a light one runs
inline: ``screening.light``). A large request body is parsed in the same processes
(``call``: ``fronts.body``).

Why processes and not threads: the PII rules are Python regular expressions, which hold the
GIL. A CPU-bound thread hands the GIL back to the event loop only every 5 ms switch interval,
and the loop gives it up again at every system call. Measured (a 1 ms ticker on the loop while
two jobs masked 512 KB of "1 1 1 ..." each, 2 cores): inline, the loop stalled 676 ms; in two
threads every wakeup was late by 8.7 ms at the median and 91 ms at worst; in two processes
0.2 ms and 17 ms. The injection screen's RE2 searches do let go of the GIL, its word split does
not. Chunking the work on the loop (``await asyncio.sleep(0)`` between pieces) would bound each
stall but still spend the loop's one core on the attacker's prompt.

A job that runs past its deadline is stopped in the worker (SIGALRM) and the request refused
(400 ``guard_timeout``): the rules are linear, so only a prompt far larger than any model's
context gets there. A job whose worst-case bound (``screening.worst_seconds``) is over twice
the time left is refused at once, so a hopeless prompt costs a worker ~0.1 s, not the deadline.
More jobs than ``queue`` waiting is a 429 (``guards_busy``).

The workers run at a lower priority (``NICE``, against every process of the machine:
``llmesh.workers.lower_priority``): on a busy machine the gateway's event loop, and so every other
request, gets the CPU before an attacker's prompt does."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from types import FrameType
from typing import TypeVar

from llmesh.errors import InvalidArgument, LlmeshError, Overloaded, Unavailable
from llmesh.malloc import keep_large_blocks
from llmesh.orphans import die_with
from llmesh.workers import lower_priority
from llmesh.gateway.domain.guards import screening
from llmesh.gateway.domain.guards.screening import GuardJob, GuardResult

log = logging.getLogger("llmesh.gateway.guards")
T = TypeVar("T")
NICE = 10  # added to the gateway's niceness: under contention a worker gets ~1/10 of a core's share


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise _Timeout


def _work(job: GuardJob, deadline: float) -> GuardResult | None:
    """In the worker: the job, or None when ``deadline`` (time.monotonic, the same clock in every
    process of the machine) passed before it finished."""
    remaining = deadline - time.monotonic()
    if remaining <= 0 or (job.kinds is not None and screening.worst_seconds(job) > 2 * remaining):
        return None  # late, or hopeless: not worth the deadline's time of a worker
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, remaining)
    try:
        return screening.run(job)
    except _Timeout:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _ready() -> int:
    return os.getpid()


def _worker_init(gateway_pid: int) -> None:
    """In each worker: it dies with the gateway (a killed gateway left its workers blocked on their
    queue forever: they hold its pipe's other end, so no EOF comes), and runs at a lower priority
    than any normal process of the machine, the gateway's own loop included (``lower_priority``)."""
    die_with(gateway_pid)
    lower_priority(NICE)
    keep_large_blocks()


def _timeout(deadline_s: float) -> LlmeshError:
    return InvalidArgument(f"The prompt could not be screened (PII, prompt injection) within {deadline_s:g} s; "
                           "send a shorter prompt.", reason="guard_timeout", param="messages")


class GuardWorkers:
    """``await run(job)``: the job's result from a worker process, within ``deadline_s``."""

    def __init__(self, workers: int = 2, deadline_s: float = 5.0, queue: int = 16):
        self._workers = workers
        self._deadline_s = deadline_s
        self._queue = queue
        self._waiting = 0
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            # spawn: the gateway has threads (gRPC), which fork does not copy safely
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self._workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                initargs=(os.getpid(),))
        return self._pool

    async def start(self) -> None:
        """Starts the workers now (a spawned worker takes ~0.5 s to come up), not on the first
        large prompt."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._executor(), _ready) for _ in range(self._workers)))

    async def run(self, job: GuardJob) -> GuardResult:
        if self._waiting >= self._queue:
            retry = max(1, math.ceil(self._deadline_s / 4))
            busy = Overloaded(f"The gateway is screening {self._waiting} large prompts; retry in {retry} s.",
                              reason="guards_busy")
            busy.headers["retry-after"] = str(retry)
            raise busy
        self._waiting += 1
        try:
            deadline = time.monotonic() + self._deadline_s
            future = asyncio.get_running_loop().run_in_executor(self._executor(), _work, job, deadline)
            try:
                result = await asyncio.wait_for(future, self._deadline_s + 1.0)  # + the way there and back
            except TimeoutError:
                result = None
            except BrokenProcessPool:
                log.error("a guard worker died; starting new ones")
                self.close()
                raise Unavailable("The gateway's guard worker stopped; retry.", reason="guards_unavailable")
        finally:
            self._waiting -= 1
        if result is None:
            raise _timeout(self._deadline_s)
        return result

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker process (both picklable), its result or its exception; no
        deadline nor queue bound (the caller bounds what it sends). Unavailable when a worker died
        under it (the pool is started again on the next call)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor(), fn, *args)
        except BrokenProcessPool:
            log.error("a guard worker died; starting new ones")
            self.close()
            raise Unavailable("The gateway's worker process stopped; retry.", reason="workers_unavailable") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

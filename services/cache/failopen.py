"""Fail-open access to a store: every call has a time budget; an error or a call
over budget counts as a miss (or a store not made), and for ``pause_s`` afterwards
the store is not asked at all, so an outage costs no request more than one budget.
The cache is best effort: it never fails or delays an answer beyond its budget."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from llmesh.cache.store import Store

log = logging.getLogger("llmesh.cache.store")
T = TypeVar("T")


class FailOpen:
    def __init__(self, store: Store, budget_s: float, pause_s: float = 1.0,
                 on_error: Callable[[str], None] = lambda op: None, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self._budget = budget_s
        self._pause = pause_s
        self._on_error = on_error
        self._clock = clock
        self._closed_until = 0.0  # while in the future, the store is bypassed
        self._failing = False

    @property
    def available(self) -> bool:
        return self._clock() >= self._closed_until

    async def call(self, op: str, make: Callable[[], Awaitable[T]], default: T, budget_s: float | None = None) -> T:
        if not self.available:
            return default
        try:
            result = await asyncio.wait_for(make(), budget_s or self._budget)
        except Exception as exc:  # noqa: BLE001 - any store failure is a bypass, never a failed request
            self._closed_until = self._clock() + self._pause
            self._on_error(op)
            if not self._failing:
                log.warning("cache store unavailable; bypassing it", extra={
                    "backend": self.store.backend, "op": op, "error": type(exc).__name__, "retry_in_s": self._pause})
            self._failing = True
            return default
        if self._failing:
            log.info("cache store back", extra={"backend": self.store.backend})
            self._failing = False
        return result

"""The edge of a load a system keeps up with, searched the one way every bench here searches it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def highest(probe: Callable[[float], tuple[bool, Any]], start: float, bisect: int, floor: float = 1e-3,
            limit: int = 40) -> tuple[float, Any, int]:
    """The highest value ``probe`` passes (``probe(x)`` is (passed, what it measured)): grow by
    half from ``start`` until a probe fails, shrink by a third until one passes, then ``bisect``
    between the last pass and the first failure. Returns that value, its measure and the number
    of probes. Raises RuntimeError when nothing down to ``floor`` passes or ``limit`` probes do
    not bracket it."""
    lo: tuple[float, Any] | None = None
    hi: float | None = None
    x, probes = start, 0
    while lo is None or hi is None:
        passed, measured = probe(x)
        probes += 1
        if passed:
            lo, x = (x, measured), x * 1.5
        else:
            hi, x = x, x / 1.5
        if lo is None and x < floor:
            raise RuntimeError(f"nothing from {start} down to {floor} passes")
        if (lo is None or hi is None) and probes >= limit:
            raise RuntimeError(f"{limit} probes from {start} found no value that passes beside one that fails")
    for _ in range(bisect):
        x = (lo[0] + hi) / 2
        passed, measured = probe(x)
        probes += 1
        lo, hi = ((x, measured), hi) if passed else (lo, x)
    return lo[0], lo[1], probes

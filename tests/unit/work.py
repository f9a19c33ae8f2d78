"""Work measured by counting calls, not by the clock.

A test that says "linear in the size" or "refused without looking at the number" checks the
count of Python and C function calls made: the count is the same on a quiet machine and on a
loaded CI runner, where a wall-clock bound fails on a pause that has nothing to do with the code
(timings belong in bench/, which prints them)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any


def calls_made(fn: Callable[..., Any], *args: Any) -> int:
    """How many functions `fn(*args)` called (Python and C), whether it returned or raised."""
    count = 0

    def profile(_frame: FrameType, event: str, _arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a refusal is work done too; the count is the result
        pass
    finally:
        sys.setprofile(previous)
    return count

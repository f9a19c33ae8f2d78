"""glibc's allocator told to keep large freed blocks for reuse, for a process that copies large
buffers (a 16 MiB request body joined, pickled to a worker, decoded to text, encoded again).

By default glibc serves a block over its mmap threshold (128 KiB at first, raised to the size of
the last one freed) from fresh pages and returns them to the kernel on free, and trims the heap's
free top past 128 KiB: every large copy then touches pages that fault in one by one. On these
machines a 16 MiB copy took 8-10 ms that way (up to 50 ms on a busy machine), of which ~1 ms is
the copy itself; with the thresholds below, a block of that size comes back from the heap already
mapped. The price: the process keeps up to ``trim`` bytes of freed memory mapped (its RSS stays near
its high-water mark), which a gateway, whose largest buffers are bounded by its body limit, can
afford."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("llmesh.malloc")
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 << 20


def keep_large_blocks(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD,
                      prefault: tuple[int, ...] = ()) -> bool:
    """Sets glibc's mmap and trim thresholds; False (and nothing changed) where the C library is
    not glibc or refuses a value. Then maps blocks of the ``prefault`` sizes (each under
    ``mmap_threshold``) and frees them, so that the first large request finds the memory it
    copies into already there (the thread calling this; other threads' arenas map their own)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        _ = libc.gnu_get_libc_version  # only glibc has it (musl's mallopt is a stub)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    if not ok:
        log.warning("glibc refused the allocator thresholds", extra={"mmap_threshold": mmap_threshold})
        return False
    blocks = [b"\1" * size for size in prefault if size < mmap_threshold]  # written, so every page is in
    del blocks
    return True

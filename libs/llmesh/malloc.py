"""glibc's allocator told to keep large freed blocks for reuse, for a process that copies large
buffers (a 16 MiB request body joined, pickled to a worker, decoded to text, encoded again).

By default glibc serves a block over its mmap threshold (128 KiB at first, raised to the size of
the last one freed) from fresh pages and returns them to the kernel on free, and trims the heap's
free top past 128 KiB: every large copy then touches pages that fault in one by one. On these
machines a 16 MiB copy took 8-10 ms that way (up to 50 ms on a busy machine), of which ~1 ms is
the copy itself; with the thresholds below, a block of that size comes back from the heap already
mapped. The price: the process keeps up to ``trim`` bytes of freed memory mapped (its RSS stays near
its high-water mark), which a gateway, whose largest buffers are bounded by its body limit, can
afford.

Threads: glibc gives a thread that allocates while another holds the main arena's lock an arena of its
own, whose pages are fresh; a 16 MiB block first copied in such a thread (a process pool's feeder
pickling a body for a guard worker) faulted 12,288 pages in, 22 ms on an idle machine and ~70 ms on
a busy one, with the GIL held. ``arenas=1`` keeps every thread on the main arena, the one prefaulted
here (the same copy: 0 faults, 3 ms); the price, threads queueing on one malloc lock, is small in a
process whose Python threads take turns on the GIL anyway."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("llmesh.malloc")
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 << 20


def keep_large_blocks(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD,
                      prefault: tuple[int, ...] = (), arenas: int | None = None) -> bool:
    """Sets glibc's mmap and trim thresholds; False (and nothing changed) where the C library is
    not glibc or refuses a value. Then maps blocks of the ``prefault`` sizes (each under
    ``mmap_threshold``) and frees them, so that the first large request finds the memory it
    copies into already there (in the main arena: with ``arenas=1``, set before other threads
    start, they use it too; else their arenas map their own)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        _ = libc.gnu_get_libc_version  # only glibc has it (musl's mallopt is a stub)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    ok = ok and (arenas is None or mallopt(_M_ARENA_MAX, arenas) == 1)
    if not ok:
        log.warning("glibc refused the allocator thresholds", extra={"mmap_threshold": mmap_threshold})
        return False
    blocks = [b"\1" * size for size in prefault if size < mmap_threshold]  # written, so every page is in
    del blocks
    return True

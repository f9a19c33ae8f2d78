"""llmesh.malloc: a large block freed and allocated again comes back mapped (no page faults), in a
fresh interpreter each (the thresholds are process-wide)."""

import subprocess
import sys

import pytest

PROBE = """
import resource, sys
from llmesh.malloc import keep_large_blocks
tuned = sys.argv[1] == "tuned" and keep_large_blocks()
pieces = [b"x" * 65536 for _ in range(256)]
faults = []
for _ in range(4):   # what a gateway does with a 16 MiB body: join it, decode it, encode it again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    body = b"".join(pieces)
    text = body.decode()
    again = text.encode()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del body, text, again
print(int(tuned), min(faults[1:]))
"""


def _faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    tuned, faults = out.split()
    return tuned == "1", int(faults)


def test_a_freed_large_block_is_reused_without_faulting_its_pages_in_again():
    tuned, faults = _faults("tuned")
    if not tuned:
        pytest.skip("not glibc")
    _, plain = _faults("plain")
    assert plain >= 6000        # 3 x 16 MiB of 4 KiB pages fault in afresh every time by default ...
    assert faults < 300         # ... and come back mapped once the thresholds are set

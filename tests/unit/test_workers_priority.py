"""``llmesh.workers.lower_priority``: a worker niced against the whole machine, not only against
its parent's session (Linux's autogroups schedule each session as one group)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from llmesh.workers import lower_priority


def _child(out) -> None:
    lower_priority(5)
    group = Path("/proc/self/autogroup")
    out.put((os.getsid(0) == os.getpid(), os.nice(0), group.read_text().strip() if group.exists() else None))


def test_a_lowered_worker_leads_a_session_niced_as_it_is():
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(out,))
    proc.start()
    leads, nice, group = out.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0
    assert leads  # a session of its own: its scheduling group is not the parent's
    assert nice == min(19, os.nice(0) + 5)
    if group is not None:  # a kernel with autogroups: the group carries the process's nice value
        assert group.endswith(f"nice {nice}"), group
        mine = Path("/proc/self/autogroup").read_text().strip()  # empty in the root group (init's session)
        assert group.split()[0] != (mine.split() or [""])[0]  # and the parent's own group is left as it was

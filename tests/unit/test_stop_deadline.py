"""A stopping process ends itself past its deadline (llmesh.service.exit_if_stop_overruns):
one whose stop hangs where nobody is left to kill it (its parent SIGKILLed) does not run on."""

from __future__ import annotations

import json
import subprocess
import sys
import time

HANGS = r"""
import asyncio, os, sys
from llmesh.logs import setup_logging
from llmesh.service import exit_if_stop_overruns

async def main():
    exit_if_stop_overruns(float(sys.argv[1]))
    r, w = os.pipe()  # a read nobody answers: asyncio.run's teardown waits for its executor thread
    asyncio.get_running_loop().run_in_executor(None, os.read, r, 1)
    if sys.argv[2] == "ends":
        os.write(w, b"x")

setup_logging("test", "INFO")
asyncio.run(main())
"""


def run(after_s: str, mode: str) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", HANGS, after_s, mode], capture_output=True, text=True,
                          timeout=30, stdin=subprocess.DEVNULL)
    return done, time.monotonic() - began


def test_a_stop_that_hangs_past_its_deadline_exits_1_saying_so():
    done, took = run("0.5", "hangs")
    assert done.returncode == 1, done.stderr
    assert 0.5 <= took < 10
    lines = [json.loads(x) for x in done.stderr.splitlines() if x.startswith("{")]
    assert [x["after_s"] for x in lines if x["msg"] == "stop overran its deadline; exiting"] == [0.5]


def test_a_stop_that_ends_in_time_keeps_its_status_and_waits_for_no_deadline():
    done, took = run("20", "ends")
    assert done.returncode == 0, done.stderr
    assert took < 10 and "overran" not in done.stderr

"""Children of a process whose gRPC is busy: `llmesh up` and the gateway's workers' supervisor
start them without running code between fork and exec (a preexec_fn made gRPC's fork handlers
crash 1 child in 4 here, grpc/grpc#43062), and they still die with their parent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmesh.cli.up import Child
from llmesh.orphans import PARENT_ENV, with_parent
from llmesh.testing import pid_alive, wait_until

SLEEPER = ("import os, sys, time\n"
           "from llmesh.orphans import PARENT_ENV, die_with_launcher\n"
           "die_with_launcher()\n"
           "print(os.getpid(), PARENT_ENV in os.environ, flush=True)\n"
           "time.sleep(60)\n")


class BusyGrpc:
    """A gRPC server in this process and four clients calling it without pause."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._started = threading.Event()
        self.calls = 0
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._run(),), daemon=True)

    async def _run(self) -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def call() -> None:
                while not self._stop.is_set():
                    await stub.Check(health_pb2.HealthCheckRequest())
                    self.calls += 1
            callers = [asyncio.create_task(call()) for _ in range(4)]
            self._started.set()
            await self._stop.wait()
            await asyncio.gather(*callers)
        await server.stop(None)

    def __enter__(self) -> BusyGrpc:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def test_children_started_while_grpc_is_busy_all_reach_their_exec(tmp_path: Path):
    codes = []
    with BusyGrpc() as busy:
        for i in range(60):
            child = Child(f"c{i}", "llmesh.orphans", "", dict(os.environ), tmp_path / "child.log")
            child.start()
            codes.append(child.process.wait(30))
        assert busy.calls > 100  # the gRPC threads were working through the starts
    assert codes == [0] * 60, (tmp_path / "child.log").read_text()[-2000:]


def test_a_child_dies_with_the_parent_that_started_it(tmp_path: Path):
    launcher = ("import os, subprocess, sys, time\n"
                "from llmesh.orphans import with_parent\n"
                f"subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], env=with_parent(os.environ))\n"
                "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        pid_text, inherited = parent.stdout.readline().split()
        child = int(pid_text)
        assert inherited == "False"  # its own children would not take its parent for theirs
        assert pid_alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_until(lambda: not pid_alive(child), 10)
    finally:
        parent.kill()
        parent.wait(10)


def test_a_child_whose_parent_died_before_it_asked_exits_at_once():
    # The pid it names is not its parent: the launcher is gone (its pid is this test's, not the parent's).
    env = {**os.environ, PARENT_ENV: str(os.getppid())}
    done = subprocess.run([sys.executable, "-c", SLEEPER], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout == ""
    assert with_parent({})[PARENT_ENV] == str(os.getpid())

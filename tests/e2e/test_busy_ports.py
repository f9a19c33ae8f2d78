"""`llmesh up` started while some of its ports are held for a while (another program's listener on
the scheduler's port, an outgoing connection whose local port is engine-0's) comes up once they are
free, serves, and says which ports it waited for and how to reserve them."""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
from pathlib import Path

from openai import OpenAI

from llmesh.ports import BUSY_MSG
from llmesh.testing import Mesh, free_layout, wait_until

HOLD_S = 2.0  # how long each hold lasts once its service reports it waits


def _release_once_waited(log: Path, socks: list[socket.socket], released: list[str]) -> None:
    """Close ``socks`` HOLD_S after ``log`` says its service waits for the port (or after 60 s)."""
    waited = wait_until(lambda: log.exists() and BUSY_MSG in log.read_text(), 60, interval_s=0.1)
    threading.Event().wait(HOLD_S)
    for s in socks:
        s.close()
    released.append(f"{log.stem}:{waited}")


def test_llmesh_up_comes_up_once_its_held_ports_are_free(tmp_path):
    layout = free_layout(n_engines=1)
    scheduler_port = layout.port("scheduler")
    engine_port = int(layout.engine_address(0).rsplit(":", 1)[1])
    # Another program listens on the scheduler's port (no SO_REUSEPORT).
    listener = socket.socket()
    listener.bind(("127.0.0.1", scheduler_port))
    listener.listen()
    # An outgoing connection has engine-0's port as its local port, as an ephemeral port would.
    target = socket.socket()
    target.bind(("127.0.0.1", 0))
    target.listen()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # no TIME_WAIT left behind
    client.bind(("127.0.0.1", engine_port))
    client.connect(target.getsockname())
    accepted, _ = target.accept()
    log_dir = tmp_path / "logs"
    released: list[str] = []
    releasers = [threading.Thread(target=_release_once_waited, args=(log_dir / f"{name}.log", socks, released))
                 for name, socks in (("scheduler", [listener]), ("engine-0", [client, accepted]))]
    for t in releasers:
        t.start()
    mesh = Mesh(layout=layout, engines="sim", model_dir=tmp_path / "models", log_dir=log_dir)
    try:
        mesh.start(timeout_s=120)
        for t in releasers:
            t.join(timeout=5)
        assert sorted(released) == ["engine-0:True", "scheduler:True"]  # both services did wait
        client_ = OpenAI(base_url=layout.http_url + "/v1", api_key="unused", max_retries=0)
        assert wait_until(lambda: "sim-small" in {m.id for m in client_.models.list()}, 20)
        answer = client_.chat.completions.create(model="sim-small", max_tokens=2,
                                                 messages=[{"role": "user", "content": "x"}])
        assert answer.choices[0].message.content
        out = "".join(mesh.output)
        assert f"scheduler for 127.0.0.1:{scheduler_port} (held by pid {os.getpid()} (" in out, out
        assert f"engine-0 for 127.0.0.1:{engine_port} (held by pid {os.getpid()} (" in out, out
        assert f"a connection 127.0.0.1:{engine_port} -> " in out
        assert f"ip_local_reserved_ports={layout.reserved_ports()}" in out
    finally:
        mesh.stop(signal.SIGINT)
        for s in (listener, client, accepted, target):
            s.close()

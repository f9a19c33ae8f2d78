"""Binding on a busy machine (llmesh.ports): a taken port is tried again for a while, then
fails naming the port and its holder; every listener (gRPC, HTTP, /metrics) goes through it."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from llmesh.backoff import Backoff
from llmesh.cli.layout import Layout
from llmesh.cli.up import Child, StartFailed, _wait_serving, port_hint
from llmesh.metrics_http import start_metrics
from llmesh.ports import (BUSY_MSG, CLOSING_MSG, PortInUse, bind_retrying, describe_holder, foreign_listeners,
                          listen_socket, split_address)
from llmesh.rpc.server import GrpcServer
from llmesh.settings import ServiceSettings
from prometheus_client import CollectorRegistry



def fast() -> Backoff:
    return Backoff(initial_s=0.05, max_s=0.1)


def held_by_listener() -> tuple[socket.socket, int]:
    """A plain listener (no SO_REUSEPORT) on a free port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def held_by_connection() -> tuple[list[socket.socket], int]:
    """An outgoing connection whose local port is the one held (as an ephemeral port would be)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.socket()
    client.bind(("127.0.0.1", 0))
    client.connect(server.getsockname())
    accepted, _ = server.accept()
    # Closed without a TIME_WAIT on the held port: the client resets (linger 0) rather than close first.
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return [client, accepted, server], client.getsockname()[1]


def bind_plain(port: int):
    return lambda: listen_socket("127.0.0.1", port)


async def test_a_port_held_past_the_wait_fails_naming_the_port_and_this_process():
    hold, port = held_by_listener()
    try:
        started = time.monotonic()
        with pytest.raises(PortInUse) as info:
            await bind_retrying(bind_plain(port), f"127.0.0.1:{port}", wait_s=0.5, backoff=fast())
        waited = time.monotonic() - started
    finally:
        hold.close()
    message = str(info.value)
    assert f"127.0.0.1:{port} is in use" in message
    assert f"pid {os.getpid()} (" in message and "listening" in message
    assert info.value.errno == errno.EADDRINUSE
    assert 0.5 <= waited < 3


async def test_an_outgoing_connection_on_the_port_is_named_as_such():
    socks, port = held_by_connection()
    try:
        with pytest.raises(PortInUse) as info:
            await bind_retrying(bind_plain(port), f"127.0.0.1:{port}", wait_s=0, backoff=fast())
    finally:
        for s in socks:
            s.close()
    assert f"pid {os.getpid()} (" in str(info.value)
    assert f"a connection 127.0.0.1:{port} -> 127.0.0.1:" in str(info.value)


async def test_a_port_freed_during_the_wait_is_bound_and_the_wait_is_logged(caplog):
    socks, port = held_by_connection()
    threading.Timer(0.4, lambda: [s.close() for s in socks]).start()
    with caplog.at_level(logging.INFO, logger="llmesh.ports"):
        sock = await bind_retrying(bind_plain(port), f"127.0.0.1:{port}", wait_s=10, backoff=fast())
    sock.close()
    busy = [r for r in caplog.records if r.getMessage() == BUSY_MSG]
    assert len(busy) == 1 and busy[0].address == f"127.0.0.1:{port}" and f"pid {os.getpid()}" in busy[0].holder
    assert any(r.getMessage() == "port free; bound" for r in caplog.records)


async def test_a_port_held_only_by_time_wait_is_waited_for_past_the_setting(caplog):
    """A closed outgoing connection keeps its port in TIME_WAIT (up to 60 s), even against SO_REUSEADDR;
    no process can free it sooner, so the wait runs until the kernel lets it go."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.socket()
    client.bind(("127.0.0.1", 0))
    port = client.getsockname()[1]
    client.connect(server.getsockname())
    accepted, _ = server.accept()
    client.close()  # the side that closes first keeps the TIME_WAIT
    time.sleep(0.1)
    accepted.close()
    server.close()
    with pytest.raises(PortInUse, match="TIME_WAIT"):
        await bind_retrying(bind_plain(port), f"127.0.0.1:{port}", wait_s=0, backoff=fast())
    with caplog.at_level(logging.INFO, logger="llmesh.ports"), pytest.raises(TimeoutError):
        await asyncio.wait_for(bind_retrying(bind_plain(port), f"127.0.0.1:{port}", wait_s=0.2, backoff=fast()), 1.5)
    assert any(r.getMessage() == CLOSING_MSG for r in caplog.records)


async def test_other_bind_errors_are_not_retried():
    started = time.monotonic()
    with pytest.raises(OSError) as info:  # an address this machine does not have
        await bind_retrying(lambda: listen_socket("192.0.2.1", 0), "192.0.2.1:0", wait_s=10)
    assert info.value.errno == errno.EADDRNOTAVAIL and time.monotonic() - started < 1


async def test_a_grpc_server_waits_for_its_port_and_gives_up_naming_it():
    hold, port = held_by_listener()
    try:
        with pytest.raises(PortInUse) as info:
            await GrpcServer(f"127.0.0.1:{port}", [], bind_wait_s=0.3).start()
        assert f"127.0.0.1:{port} is in use, held by pid {os.getpid()}" in str(info.value)
        threading.Timer(0.5, hold.close).start()
        server = GrpcServer(f"127.0.0.1:{port}", [], bind_wait_s=10)
        await server.start()
        assert server.port == port
        await server.stop(0)
    finally:
        hold.close()


async def test_a_grpc_server_never_shares_a_port_with_a_reuse_port_listener():
    """grpc sets SO_REUSEPORT by default; ours is off, so another process's listener is refused."""
    hold = listen_socket("127.0.0.1", 0, reuse_port=True)
    hold.listen()
    port = hold.getsockname()[1]
    try:
        with pytest.raises(PortInUse):
            await GrpcServer(f"127.0.0.1:{port}", [], bind_wait_s=0.2).start()
    finally:
        hold.close()


class _OldGrpc:
    """grpcio before it raised: add_insecure_port answers 0."""

    def add_insecure_port(self, address: str) -> int:
        return 0


@pytest.mark.parametrize("held", [True, False])
def test_a_grpc_port_of_0_counts_as_busy_for_a_retry(held):
    hold, port = held_by_listener()
    if not held:
        hold.close()
    try:
        with pytest.raises(OSError) as info:
            GrpcServer(f"127.0.0.1:{port}", [])._add_port(_OldGrpc())  # type: ignore[arg-type]
    finally:
        hold.close()
    assert info.value.errno == errno.EADDRINUSE


async def test_the_metrics_server_waits_for_its_port():
    socks, port = held_by_connection()
    threading.Timer(0.3, lambda: [s.close() for s in socks]).start()
    server = await start_metrics(CollectorRegistry(), "127.0.0.1", port, wait_s=10)
    try:
        assert server.server_address[1] == port
    finally:
        server.server_close()


def test_the_wait_is_a_setting():
    assert ServiceSettings(port=1).bind_wait_s == 10.0
    assert ServiceSettings(port=1, bind_wait_s=2.5).bind_wait_s == 2.5


def test_a_listener_sharing_the_workers_port_is_found():
    ours = listen_socket("127.0.0.1", 0, reuse_port=True)
    ours.listen()
    port = ours.getsockname()[1]
    try:
        assert foreign_listeners("127.0.0.1", port, [os.getpid()]) == []
        strangers = foreign_listeners("127.0.0.1", port, [])
        assert len(strangers) == 1 and strangers[0].startswith(f"pid {os.getpid()} (")
    finally:
        ours.close()


def test_a_listeners_queued_connections_are_not_named_as_holders():
    hold, port = held_by_listener()
    queued = socket.create_connection(("127.0.0.1", port))  # in the backlog, never accepted: no process owns it
    try:
        text = describe_holder(f"127.0.0.1:{port}")
    finally:
        queued.close()
        hold.close()
    assert text.startswith(f"pid {os.getpid()} (") and text.endswith("), a listening socket")
    assert "no process owns" not in text and ";" not in text


def test_the_ports_to_reserve_cover_every_port_of_the_layout():
    assert Layout().reserved_ports() == "50051-50350,8080"
    assert Layout(base_port=20000, http_port=20009).reserved_ports() == "20000-20299"


def test_the_holder_of_a_free_port_is_unknown():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    assert "cannot see" in describe_holder(f"127.0.0.1:{port}")


def test_addresses_split_with_brackets():
    assert split_address("[::1]:50051") == ("::1", 50051)
    assert split_address("0.0.0.0:8080") == ("0.0.0.0", 8080)
    with pytest.raises(ValueError):
        split_address("unix:/tmp/x")


def test_llmesh_up_names_the_sysctl_when_a_service_had_to_wait(tmp_path):
    log = tmp_path / "scheduler.log"
    log.write_text('{"msg": "old run"}\n')
    child = Child("scheduler", "llmesh.scheduler", "127.0.0.1:50052", {}, log)
    child.log_start = log.stat().st_size
    assert port_hint([child], Layout()) is None
    with log.open("a") as f:
        f.write('{"level": "warning", "msg": "%s", "address": "127.0.0.1:50052", "holder": "pid 7 (nc)"}\n' % BUSY_MSG)
    hint = port_hint([child], Layout())
    assert hint is not None and "scheduler for 127.0.0.1:50052 (held by pid 7 (nc))" in hint
    assert "sysctl -w net.ipv4.ip_local_reserved_ports=50051-50350,8080" in hint


async def test_llmesh_up_says_why_a_service_could_not_start(tmp_path):
    log = tmp_path / "scheduler.log"
    log.write_text('{"level": "error", "msg": "cannot start", "error": "127.0.0.1:50052 is in use, held by pid 7"}\n')
    child = Child("scheduler", "llmesh.scheduler", "127.0.0.1:1", {}, log)
    child.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    await asyncio.to_thread(child.proc.wait)
    with pytest.raises(StartFailed, match=r"scheduler exited with code 1: 127\.0\.0\.1:50052 is in use, held by pid 7"):
        await _wait_serving(child, 5)

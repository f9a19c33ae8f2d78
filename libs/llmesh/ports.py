"""Binding a listening port on a busy machine.

Every listener of the mesh (the services' gRPC servers, the gateway's HTTP socket, the /metrics
servers) binds through :func:`bind_retrying`: a port that is taken is tried again, with backoff,
for a few seconds (``bind_wait_s``), because on a machine that makes many outgoing connections a
port in the kernel's ephemeral range (32768-60999 by default, where the mesh's default ports sit)
is now and then some connection's local port for a moment. Past the wait it fails with an
:class:`PortInUse` that names the port and, where it can tell, the holder: /proc/net/tcp{,6}
give the socket's inode, /proc/PID/fd the process owning it (best effort, within a time bound).

A service logs ``BUSY_MSG`` (with ``address`` and ``holder``) when it starts waiting, which is
how ``llmesh up`` knows to print its hint about reserving the mesh's ports."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from llmesh.backoff import Backoff

log = logging.getLogger("llmesh.ports")
T = TypeVar("T")

DEFAULT_BIND_WAIT_S = 10.0
BUSY_MSG = "port in use; waiting for it"
CLOSING_MSG = "port held by closing connections only; waiting for the kernel to let them go"
TIME_WAIT_S = 60.0  # Linux's TCP_TIMEWAIT_LEN: how long a closed connection keeps its port at most
RESERVE_DOC = "docs/operations.md, Ports"
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_STATES = {"01": "connected", "02": "connecting", "0A": "listening", "06": "closing (TIME_WAIT)",
           "04": "closing", "05": "closing", "08": "closing", "09": "closing", "0B": "closing"}
_LOOKUP_BUDGET_S = 0.5


class PortInUse(OSError):
    """The port stayed taken for the whole wait."""

    def __init__(self, message: str):
        super().__init__(errno.EADDRINUSE, message)

    def __str__(self) -> str:
        return str(self.strerror)


def split_address(address: str) -> tuple[str, int]:
    """'127.0.0.1:50051' -> ('127.0.0.1', 50051); '[::1]:50051' -> ('::1', 50051)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def listen_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening) as our servers bind: SO_REUSEADDR (a
    closing connection does not block a restart); SO_REUSEPORT only for worker processes that
    share the port, so another process's listener is refused, never silently shared."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def probe(host: str, port: int, *, reuse_port: bool = False) -> None:
    """Raises the OSError a server binding host:port would meet now (none if it is free)."""
    listen_socket(host, port, reuse_port=reuse_port).close()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def reserve_hint(ports: str) -> str:
    """How to keep outgoing connections off ``ports`` ('50051-50350,8080')."""
    return f"sudo sysctl -w net.ipv4.ip_local_reserved_ports={ports} ({RESERVE_DOC})"


async def bind_retrying(bind: Callable[[], T], address: str, *, wait_s: float = DEFAULT_BIND_WAIT_S,
                        backoff: Backoff | None = None) -> T:
    """``bind()`` (which binds ``address``), tried again while it fails with EADDRINUSE, for up
    to ``wait_s`` seconds; then :class:`PortInUse` naming the address and its holder. Any other
    error is raised at once. A port that only connections in TIME_WAIT still hold (no process
    owns them; the kernel lets them go within 60 s) is waited for up to TIME_WAIT_S + 5 s."""
    backoff = backoff or Backoff(initial_s=0.1, max_s=1.0)
    backoff.reset()
    started = time.monotonic()
    deadline = started + wait_s
    held: Holders | None = None
    while True:
        try:
            result = bind()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            if held is None or time.monotonic() >= deadline:
                held = await asyncio.to_thread(holders, address)
                if held.closing_only and wait_s > 0 and deadline < started + TIME_WAIT_S + 5:
                    deadline = started + TIME_WAIT_S + 5
                    log.warning(CLOSING_MSG, extra={"address": address, "holder": held.text})
            if time.monotonic() >= deadline:
                raise PortInUse(_gave_up(address, held.text, time.monotonic() - started)) from exc
            if backoff.attempts == 0:
                log.warning(BUSY_MSG, extra={"address": address, "holder": held.text, "wait_s": wait_s})
            await asyncio.sleep(min(backoff.next(), max(deadline - time.monotonic(), 0.0)))
            continue
        if backoff.attempts:
            log.info("port free; bound", extra={"address": address,
                                                "waited_s": round(time.monotonic() - started, 2)})
        return result


def _gave_up(address: str, holder: str, waited_s: float) -> str:
    text = f"{address} is in use, held by {holder}; waited {waited_s:.1f} s for it"
    try:
        port = split_address(address)[1]
    except ValueError:
        return text
    low, high = ephemeral_range()
    if low <= port <= high:
        text += (f". Port {port} is in the kernel's range for outgoing connections ({low}-{high}): "
                 f"{reserve_hint(str(port))}")
    return text


@dataclass(frozen=True)
class TcpSocket:
    """One row of /proc/net/tcp{,6}."""
    local: str
    remote: str
    state: str
    uid: int
    inode: int

    @property
    def what(self) -> str:
        state = _STATES.get(self.state, f"state {self.state}")
        return f"a connection {self.local} -> {self.remote}" if state == "connected" else f"a {state} socket"


def _ip(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    ip = ipaddress.IPv6Address(words)
    return str(ip.ipv4_mapped or ip)


def _endpoint(field: str) -> tuple[str, int]:
    hex_ip, hex_port = field.split(":")
    return _ip(hex_ip), int(hex_port, 16)


def _clashes(ip: str, host: str) -> bool:
    """A socket bound to ``ip`` keeps a listener on ``host`` off the same port."""
    try:
        want = ipaddress.ip_address(host)
    except ValueError:
        return True  # a name: any address may be it
    mapped = want.ipv4_mapped if isinstance(want, ipaddress.IPv6Address) else None
    have = ipaddress.ip_address(ip)
    return have.is_unspecified or want.is_unspecified or have == (mapped or want)


def sockets_on(host: str, port: int, tables: Iterable[str] = _TABLES) -> list[TcpSocket]:
    """The TCP sockets of this network namespace on ``port`` whose address clashes with ``host``."""
    found = []
    for table in tables:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10:
                continue
            (ip, lport), (rip, rport) = _endpoint(cols[1]), _endpoint(cols[2])
            if lport == port and _clashes(ip, host):
                found.append(TcpSocket(f"{ip}:{lport}", f"{rip}:{rport}", cols[3], int(cols[7]), int(cols[9])))
    return found


def _inodes_of(pid: int | str) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def owners(inodes: set[int], pids: Sequence[int] | None = None,
           budget_s: float = _LOOKUP_BUDGET_S) -> tuple[dict[int, int], bool]:
    """({inode: pid} for the sockets found among ``pids`` (default: this process first, then every
    process), whether the search ended before looking everywhere (out of time)."""
    found: dict[int, int] = {}
    deadline = time.monotonic() + budget_s
    candidates: Iterable[int | str] = pids if pids is not None else (
        os.getpid(), *(p for p in os.listdir("/proc") if p.isdigit()))
    for pid in candidates:
        if found.keys() >= inodes:
            return found, False
        if time.monotonic() > deadline:
            return found, True
        for inode in _inodes_of(pid) & (inodes - found.keys()):
            found[inode] = int(pid)
    return found, False


def command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes() or Path(f"/proc/{pid}/comm").read_bytes()
    except OSError:
        return "?"
    text = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Holders:
    text: str            # who holds the port, in words
    closing_only: bool   # only closed connections no process owns (TIME_WAIT): they go away on their own


def holders(address: str) -> Holders:
    """Who holds ``address``'s port; best effort, in well under a second."""
    try:
        host, port = split_address(address)
    except ValueError:
        return Holders("an unknown holder", False)
    held = sockets_on(host, port)
    if not held:
        return Holders("a socket we cannot see (none on that port in /proc/net/tcp{,6}: bound but neither "
                       "listening nor connected, or in another network namespace)", False)
    pids, cut_short = owners({s.inode for s in held if s.inode})
    closing_only = all(s.state == "06" and not s.inode for s in held)
    if any(s.inode for s in held):  # the rest: a listener's queued connections, closed ones
        held = [s for s in held if s.inode]
    parts = []
    for s in held[:3]:
        if s.inode in pids:
            pid = pids[s.inode]
            parts.append(f"pid {pid} ({command_line(pid)}), {s.what}")
        elif not s.inode:
            parts.append(f"{s.what} no process owns any more")
        else:
            why = "the search ran out of time" if cut_short else "its process is not visible to us"
            parts.append(f"{s.what} of uid {s.uid} ({why})")
    return Holders("; ".join(parts), closing_only)


def describe_holder(address: str) -> str:
    """Who holds ``address``'s port, in words."""
    return holders(address).text


def foreign_listeners(host: str, port: int, pids: Sequence[int]) -> list[str]:
    """Listening sockets on host:port that none of ``pids`` owns, in words: with SO_REUSEPORT the
    kernel lets another process of the same user listen beside our workers and take a share of
    their connections."""
    listening = {s.inode: s for s in sockets_on(host, port) if s.state == "0A" and s.inode}
    ours, _ = owners(set(listening), pids)
    strangers = [inode for inode in listening if inode not in ours]
    if not strangers:
        return []
    theirs, _ = owners(set(strangers))
    return [f"pid {theirs[i]} ({command_line(theirs[i])})" if i in theirs else f"a socket of uid {listening[i].uid}"
            for i in strangers]

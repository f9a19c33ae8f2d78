"""Helpers to run real llmesh processes from tests and benchmarks: free ports, a
whole mesh under ``llmesh up``, single services. Everything binds 127.0.0.1 and
every process started here is stopped here."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmesh.cli.layout import Layout


class _Handed:
    """Ports this process handed out lately: a port is free until the service it was chosen for
    binds it, so it is not handed out again meanwhile (a Redis started after a mesh's layout was
    chosen once took the gateway's port). Forgotten after ``keep_s``: by then it is bound or let go."""

    def __init__(self, keep_s: float = 120.0) -> None:
        self.keep_s = keep_s
        self._at: dict[int, float] = {}
        self._lock = threading.Lock()

    def take(self, ports: list[int]) -> bool:
        """Whether none of ``ports`` was handed out lately; if so, they are now."""
        now = time.monotonic()
        with self._lock:
            self._at = {p: t for p, t in self._at.items() if now - t < self.keep_s}
            if any(p in self._at for p in ports):
                return False
            self._at.update(dict.fromkeys(ports, now))
            return True


_HANDED = _Handed()  # per process, as the ports' users are; tests and benchmarks only


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_layout(n_engines: int = 4) -> Layout:
    """A base port whose service and engine ports are all free, and a free HTTP port."""
    rng = random.Random()
    for _ in range(200):
        # Below the kernel's ephemeral range (32768+ here): a port there can be taken by any
        # outgoing connection between our check and the service's bind.
        base = rng.randrange(10000, 32000)
        ports = ([base + i for i in range(4)] + [base + 20 + i for i in range(4)] + [base + 9]
                 + [base + off + i for off in (100, 200) for i in range(n_engines)])
        if all(_port_free(p) for p in ports) and _HANDED.take(ports):
            return Layout(base_port=base, http_port=base + 9)
    raise RuntimeError("no free port range found")


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out.append(int(entry.name))
    return out


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass
class Mesh:
    """``llmesh up`` as a child process."""
    layout: Layout
    engines: str
    model_dir: Path
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)  # more `llmesh up` flags
    embeddings: bool = False  # False: --no-embeddings (a test mesh runs the engines it names, no more)
    proc: subprocess.Popen[str] | None = None
    output: list[str] = field(default_factory=list)

    def start(self, timeout_s: float = 180.0) -> None:
        cmd = [sys.executable, "-m", "llmesh", "up", "--base-port", str(self.layout.base_port),
               "--http-port", str(self.layout.http_port), "--engines", self.engines,
               "--model-dir", str(self.model_dir), "--log-dir", str(self.log_dir), "--grace", "5", *self.args,
               *(() if self.embeddings else ("--no-embeddings",))]
        # Keys, audit logs and snapshots of this mesh stay in its own folder, never the checkout's var/state.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLMESH_STATE_DIR": str(self.log_dir / "state"), **self.env}
        self.proc = proc = subprocess.Popen(cmd, env=env,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                            stdin=subprocess.DEVNULL)
        reader = threading.Thread(target=self._read_output, daemon=True)
        reader.start()
        up = wait_until(lambda: any("llmesh is up" in line for line in self.output) or proc.poll() is not None,
                        timeout_s)
        if not up or proc.poll() is not None:
            self.stop()
            raise RuntimeError("mesh did not start:\n" + "".join(self.output) + "\n" + self.logs())

    def _read_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None  # started with a pipe
        for line in self.proc.stdout:
            self.output.append(line)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.log_dir.glob("*.log")))

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> int:
        return terminate(self.proc, sig, timeout_s)

    def metrics_ports(self) -> dict[str, int]:
        """The /metrics port of each live process of the mesh (as its supervisor.json names them)."""
        path = self.log_dir / "supervisor.json"
        # written just after the "llmesh is up" line that start() waits for
        if not wait_until(path.is_file, 5.0):
            raise RuntimeError(f"no {path}: is the mesh running?")
        state = json.loads(path.read_text())
        return {c["name"]: self.layout.metrics_port(c["name"]) for c in state["children"] if c["alive"]}

    def wait_for_config(self, revision: int, timeout_s: float = 10.0) -> None:
        """Block until every process of the mesh runs config ``revision`` (or a newer one)."""
        wait_for_config_revision(self.metrics_ports(), revision, timeout_s)


@dataclass
class Service:
    """One service module (``llmesh.engine`` etc.) as a child process."""
    module: str
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    args: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLMESH_STATE_DIR": str(self.log_path.parent / "state"),
                   "LLMESH_TRUST": "local", **self.env}
            self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        return terminate(self.proc, sig, timeout_s)


def terminate(proc: subprocess.Popen[bytes] | subprocess.Popen[str] | None, sig: int, timeout_s: float) -> int:
    """Send ``sig``, wait, SIGKILL after ``timeout_s``; the exit code (0 if never started)."""
    if proc is None:
        return 0
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


async def wait_until_async(predicate: Callable[[], object], timeout_s: float = 10.0,
                           interval_s: float = 0.02) -> bool:
    """``wait_until`` for async tests: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval_s)
    return bool(predicate())


def metric_values(port: int, name: str, timeout_s: float = 2.0) -> list[float]:
    """The values of the samples called ``name`` on the /metrics page at 127.0.0.1:``port``;
    empty when the page does not answer."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s).text
    except httpx.HTTPError:
        return []
    return [s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def write_config_file(path: Path, text: str) -> int:
    """Replace a live-config file in one step (as ``FileStore.write`` does, so no service
    reads it half written); the revision the services will report for it (its mtime in ns).
    A file's clock ticks coarsely (a few ms): a write in the same tick as the last one would
    repeat its revision, which services ignore, so it is written again on the next tick."""
    last = path.stat().st_mtime_ns if path.exists() else -1
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    while True:
        tmp.write_text(text)
        tmp.replace(path)
        revision = path.stat().st_mtime_ns
        if revision > last:
            return revision
        time.sleep(0.005)


def wait_for_config_revision(metrics_ports: Mapping[str, int], revision: int, timeout_s: float = 10.0) -> None:
    """Block until every service (name -> its /metrics port) reports ``llmesh_config_revision``
    at ``revision`` or later: the config a test wrote is the one in force. Polls instead of
    sleeping; after ``timeout_s``, AssertionError naming each service behind, the revision it
    reports and how many documents it rejected."""
    if not metrics_ports:
        raise ValueError("no service to wait for")
    behind = dict(metrics_ports)
    deadline = time.monotonic() + timeout_s
    while True:
        # The gauge is a float: a file's ns mtime compares after the same rounding.
        behind = {name: port for name, port in behind.items()
                  if not any(v >= float(revision) for v in metric_values(port, "llmesh_config_revision"))}
        if not behind or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if behind:
        report = ", ".join(
            f"{name} at {metric_values(port, 'llmesh_config_revision') or 'no revision'} "
            f"(rejected {sum(metric_values(port, 'llmesh_config_rejected_total'))})" for name, port in behind.items())
        raise AssertionError(f"config revision {revision} not in force within {timeout_s} s: {report}")


@dataclass
class EtcdServer:
    """A real etcd (Debian's etcd-server) on free 127.0.0.1 ports with its own data dir."""
    data_dir: Path
    port: int = 0
    peer_port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> None:
        if not self.port:
            self.port, self.peer_port = free_ports(2)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        url, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        log = (self.data_dir.parent / f"{self.data_dir.name}.log").open("ab")
        self.proc = proc = subprocess.Popen(
            ["etcd", "--name", "test", "--data-dir", str(self.data_dir), "--listen-client-urls", url,
             "--advertise-client-urls", url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        if not wait_until(lambda: port_open(self.port) or proc.poll() is not None, timeout_s):
            raise RuntimeError("etcd did not start")
        if self.proc.poll() is not None:
            raise RuntimeError(f"etcd exited with {self.proc.returncode}")

    def stop(self) -> None:
        terminate(self.proc, signal.SIGTERM, 10.0)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def free_ports(n: int) -> list[int]:
    """n distinct free ports below the ephemeral range (see free_layout)."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(10000, 32700)
        if _port_free(port) and _HANDED.take([port]):  # one handed out (in ports too) is not again
            ports.append(port)
    return ports


@dataclass
class RedisServer:
    """A real redis-server (Debian's) on a free 127.0.0.1 port, no persistence."""
    data_dir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        if not self.port:
            (self.port,) = free_ports(1)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = (self.data_dir / "redis.log").open("ab")
        self.proc = proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
             "--save", "", "--appendonly", "no", "--protected-mode", "yes"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        if not wait_until(lambda: port_open(self.port) or proc.poll() is not None, timeout_s):
            raise RuntimeError("redis-server did not start")
        if self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}")

    def stop(self) -> None:
        terminate(self.proc, signal.SIGTERM, 10.0)


def postgres_bin(name: str) -> str:
    """Debian keeps PostgreSQL's server programs under /usr/lib/postgresql/N/bin."""
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if found:
        return str(found[-1])
    import shutil
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"PostgreSQL's {name} is not installed: apt-get install postgresql (make test does)")
    return path


@dataclass
class PostgresServer:
    """A real PostgreSQL cluster in its own directory on a free 127.0.0.1 port.
    initdb refuses to run as root, so as root the cluster belongs to the
    'postgres' user that Debian's package creates."""
    data_dir: Path
    port: int = 0
    user: str = "llmesh"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{self.user}"

    def _as_owner(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv

    def start(self, timeout_s: float = 30.0) -> None:
        if not self.port:
            (self.port,) = free_ports(1)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            import shutil
            shutil.chown(self.data_dir, "postgres", "postgres")
            shutil.chown(self.data_dir.parent, "postgres", "postgres")
        subprocess.run(self._as_owner([postgres_bin("initdb"), "-D", str(self.data_dir), "-U", self.user,
                                       "--auth=trust", "-E", "UTF8", "--no-sync"]),
                       check=True, capture_output=True)
        self.proc = proc = subprocess.Popen(
            self._as_owner([postgres_bin("postgres"), "-D", str(self.data_dir), "-p", str(self.port),
                            "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.data_dir}",
                            "-c", "fsync=off"]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        if not wait_until(lambda: port_open(self.port) or proc.poll() is not None, timeout_s):
            raise RuntimeError("postgres did not start")
        if self.proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {self.proc.returncode}")
        time.sleep(0.3)
        subprocess.run(self._as_owner([postgres_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port),
                                       "-U", self.user, self.user]), check=True, capture_output=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # As root, proc is runuser, which does not pass signals on: tell the postmaster itself
            # (else runuser is killed after the timeout and PostgreSQL is left running).
            try:
                os.kill(int((self.data_dir / "postmaster.pid").read_text().split()[0]), signal.SIGINT)
            except (OSError, ValueError, IndexError):
                pass
        terminate(self.proc, signal.SIGINT, 15.0)

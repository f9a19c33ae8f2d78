"""``llmesh up``: run the whole mesh on one machine, one process per service.

Children start in their own session (so a terminal's Ctrl-C reaches only us) and
are told by the kernel to stop if we die (PR_SET_PDEATHSIG), so none is orphaned.
We start them in dependency order, wait for each to report SERVING, restart one
that dies (exponential backoff, a budget of restarts per window), and stop them in
reverse order with SIGTERM, then SIGKILL after the grace period."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmesh.rpc.health import health_status
from llmesh.rpc.identity import Identity, Trust
from llmesh.cli.layout import CORE_SERVICES, Layout
from llmesh.cli.secure import TRUST_ENV, child_env, make_pki
from llmesh.ports import BUSY_MSG, reserve_hint
from llmesh.restarts import RestartBudget, RestartPolicy
from llmesh.orphans import with_parent

@dataclass
class Child:
    name: str
    module: str
    address: str
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0
    last_exit_code: int | None = None
    log_start: int = 0  # where the last start's lines begin in log_path

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.log_start = log.tell()
        self.proc = subprocess.Popen([sys.executable, "-m", self.module], env=with_parent(self.env), stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reap_group(self) -> None:
        """SIGKILL what is left of the exited child's process group (its own session): processes
        it started that do not die with it, such as vLLM's engine core after a kill -9 of its
        engine, which would hold their memory and cores beside the restarted one."""
        if self.proc is not None and self.proc.poll() is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The process start() began (the last one, after restarts)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.proc

    def records(self, msg: str, limit_bytes: int = 1 << 20) -> list[dict[str, Any]]:
        """The JSON log lines with this ``msg`` the last start wrote (within its first ``limit_bytes``)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self.log_start)
                text = f.read(limit_bytes)
        except OSError:
            return []
        needle = json.dumps(msg).encode()
        found = []
        for line in text.splitlines():
            if needle in line:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("msg") == msg:
                        found.append(record)
        return found


EMBED_MODEL = "all-minilm-l6-v2"  # the cache's sentence embedder, extracted by `make model`; also served
# for /v1/embeddings by a ``minilm`` engine (MeshSpec.embeddings)


@dataclass
class MeshSpec:
    layout: Layout
    engines: list[str]              # backend per engine: "llamacpp" | "sim" | "vllm"
    model_dir: Path
    log_dir: Path
    model: str = "smollm2-135m-instruct"
    sim_model: str = "sim-small"
    vllm_model: str = "smollm2-135m-instruct-hf-fp32"  # a Hugging Face directory in model_dir
    grace_s: float = 10.0
    cache: bool = True
    gateway_workers: int = 1       # worker processes under the gateway's supervisor (llmesh.workers)
    trust: Trust = "local"         # "tls" / "token": `llmesh up --secure` (llmesh.cli.secure)
    pki_dir: Path | None = None    # the mesh's certificates, when not local
    embeddings: bool = False       # one more engine (backend minilm) serves EMBED_MODEL for /v1/embeddings

    def trust_env(self, instance: str) -> dict[str, str]:
        return child_env(self.trust, self.pki_dir, instance)

    def engine_model(self, backend: str) -> str:
        """The model an engine of ``backend`` serves unless told otherwise."""
        return {"llamacpp": self.model, "vllm": self.vllm_model, "minilm": EMBED_MODEL}.get(backend, self.sim_model)


def base_env() -> dict[str, str]:
    # each child gets its own trust variables (MeshSpec.trust_env): "local" unless --secure, where every
    # service listens on 127.0.0.1 (Layout.host)
    base = {k: v for k, v in os.environ.items() if k not in TRUST_ENV}
    base.setdefault("PYTHONUNBUFFERED", "1")
    return base


def engine_child(spec: MeshSpec, index: int, backend: str, model: str | None = None) -> Child:
    """Engine ``index`` (its ports follow from the index) serving ``model`` (default:
    the mesh's model for that backend)."""
    lay = spec.layout
    name, address = f"engine-{index}", lay.engine_address(index)
    if spec.pki_dir is not None and spec.trust != "local":
        make_pki(spec.pki_dir, [name])  # an engine the autoscaler adds gets its certificate here
    model = model or spec.engine_model(backend)
    # vLLM loads the model's Hugging Face directory from the model dir (the gateway reads its tokenizer there)
    vllm = {"LLMESH_ENGINE_VLLM_MODEL_PATH": str(spec.model_dir / model)} if backend == "vllm" else {}
    env = {"LLMESH_ENGINE_PORT": address.rsplit(":", 1)[1], "LLMESH_ENGINE_BACKEND": backend,
           "LLMESH_ENGINE_MODEL": model, **vllm,
           "LLMESH_ENGINE_MODEL_DIR": str(spec.model_dir), "LLMESH_ENGINE_ENDPOINT_ID": name,
           "LLMESH_ENGINE_SCHEDULER_ADDRESS": lay.address("scheduler"), "LLMESH_ENGINE_GRACE_S": str(spec.grace_s),
           "LLMESH_ENGINE_MODELMGR_ADDRESS": lay.address("modelmgr"),  # the model dir is shared: nothing moves
           "LLMESH_ENGINE_METRICS_PORT": str(lay.metrics_port(name)), **spec.trust_env(name)}
    return Child(name, "llmesh.engine", address, {**base_env(), **env}, spec.log_dir / f"{name}.log")


def plan(spec: MeshSpec) -> list[Child]:
    """The processes of the mesh, in start order."""
    lay = spec.layout
    base = base_env()
    children: list[Child] = []

    def add(name: str, service: str, address: str, env: dict[str, str]) -> None:
        children.append(Child(name, f"llmesh.{service}", address, {**base, **env, **spec.trust_env(name)},
                              spec.log_dir / f"{name}.log"))

    def metrics(name: str, prefix: str) -> dict[str, str]:
        return {f"LLMESH_{prefix}_METRICS_PORT": str(lay.metrics_port(name))}

    add("scheduler", "scheduler", lay.address("scheduler"), {
        "LLMESH_SCHEDULER_PORT": str(lay.port("scheduler")), **metrics("scheduler", "SCHEDULER")})
    add("modelmgr", "modelmgr", lay.address("modelmgr"), {
        "LLMESH_MODELMGR_PORT": str(lay.port("modelmgr")), "LLMESH_MODELMGR_MODEL_DIR": str(spec.model_dir),
        "LLMESH_MODELMGR_SCHEDULER_ADDRESS": lay.address("scheduler"),
        **metrics("modelmgr", "MODELMGR")})
    add("cache", "cache", lay.address("cache"), {"LLMESH_CACHE_PORT": str(lay.port("cache")),
                                                 "LLMESH_CACHE_EMBED_MODEL_DIR": str(spec.model_dir / EMBED_MODEL),
                                                 **metrics("cache", "CACHE")})
    children += [engine_child(spec, i, backend) for i, backend in enumerate(spec.engines)]
    if spec.embeddings:  # after the --engines ones (the local autoscaler's engines take free indexes after them)
        children.append(engine_child(spec, len(spec.engines), "minilm"))
    add("gateway", "gateway", lay.address("gateway"), {
        "LLMESH_GATEWAY_PORT": str(lay.port("gateway")),
        "LLMESH_GATEWAY_HTTP_PORT": str(lay.http_port),
        "LLMESH_GATEWAY_SCHEDULER_ADDRESS": lay.address("scheduler"),
        "LLMESH_GATEWAY_MODELMGR_ADDRESS": lay.address("modelmgr"),
        "LLMESH_GATEWAY_CACHE_ADDRESS": lay.address("cache") if spec.cache else "",
        "LLMESH_GATEWAY_GRACE_S": str(spec.grace_s), "LLMESH_GATEWAY_MODEL_DIR": str(spec.model_dir),
        "LLMESH_GATEWAY_WORKERS": str(spec.gateway_workers), **metrics("gateway", "GATEWAY"),
        # production trust: callers need an API key or a JWT, whatever the key store holds
        **({"LLMESH_GATEWAY_REQUIRE_AUTH": "true"} if spec.trust != "local" else {})})
    assert [c.name for c in children[:3]] == list(CORE_SERVICES)
    return children


class StartFailed(RuntimeError):
    pass


async def _wait_serving(child: Child, timeout_s: float, identity: Identity | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            why = "".join(f": {r['error']}" for r in child.records("cannot start")[-1:] if r.get("error"))
            raise StartFailed(f"{child.name} exited with code {child.process.returncode}{why}; see {child.log_path}")
        service = child.module.removeprefix("llmesh.")
        # the gateway's gRPC port is its public front (API keys, not mesh identities): plaintext
        if await health_status(child.address, timeout_s=0.5, identity=None if service == "gateway" else identity,
                               target_service=service) == "SERVING":
            return
        await asyncio.sleep(0.1)
    raise StartFailed(f"{child.name} did not become SERVING at {child.address} within {timeout_s:.0f}s; "
                      f"see {child.log_path}")


async def start_all(children: list[Child], timeout_s: float = 120.0, identity: Identity | None = None) -> None:
    """``identity``: the supervisor's (the cli certificate's) on a secure mesh, to ask each child's health."""
    core = [c for c in children if c.name in CORE_SERVICES]
    engines = [c for c in children if c.name.startswith("engine-")]
    gateway = [c for c in children if c.name == "gateway"]
    for group in (core, engines, gateway):
        for child in group:
            child.start()
        await asyncio.gather(*(_wait_serving(c, timeout_s, identity) for c in group))


def port_hint(children: list[Child], layout: Layout) -> str | None:
    """One line, if a service had to wait at start for a port someone else held (llmesh.ports)."""
    waits = [f"{c.name} for {r.get('address')} (held by {r.get('holder')})"
             for c in children for r in c.records(BUSY_MSG)]
    if not waits:
        return None
    return (f"llmesh: waited for busy ports: {'; '.join(waits)}. To keep outgoing connections off the mesh's "
            f"ports: {reserve_hint(layout.reserved_ports())}")


def stop_all(children: list[Child], grace_s: float) -> list[tuple[str, int]]:
    """SIGTERM in reverse start order (front door first), then SIGKILL what is left."""
    for child in reversed(children):
        if child.alive():
            child.process.send_signal(signal.SIGTERM)
            try:
                child.process.wait(timeout=grace_s + 2)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        child.reap_group()
    return [(c.name, c.proc.returncode) for c in children if c.proc is not None]


@dataclass
class GaveUp:
    name: str
    exits: int
    window_s: float
    last_exit_code: int | None


def write_state(children: list[Child], path: Path) -> None:
    """What ``llmesh status`` shows about the processes: pid, restarts, last exit code."""
    state = {"supervisor_pid": os.getpid(), "children": [
        {"name": c.name, "address": c.address, "pid": c.proc.pid if c.proc else None, "alive": c.alive(),
         "restarts": c.restarts, "last_exit_code": c.last_exit_code} for c in children]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


async def supervise(children: list[Child], stop: asyncio.Event, policy: RestartPolicy = RestartPolicy(),
                    state_path: Path | None = None, say: Callable[[str], None] = print) -> GaveUp | None:
    """Restarts children that die until a stop request (returns None) or until one
    dies more often than the policy allows (returns which)."""
    budgets: dict[str, RestartBudget] = {}
    # pending restarts by child: the launcher adds and removes engines while we run
    due: dict[int, float] = {}   # id(child) -> monotonic time of its pending restart
    if state_path:
        write_state(children, state_path)
    while not stop.is_set():
        now, changed = time.monotonic(), False
        live = {id(c) for c in children}
        for key in [k for k in due if k not in live]:
            del due[key]
        for child in list(children):
            if id(child) in due:
                if now >= due[id(child)]:
                    del due[id(child)]
                    child.start()
                    child.restarts += 1
                    changed = True
                    say(f"llmesh: restarted {child.name} (pid {child.process.pid}, restart {child.restarts})")
                continue
            if child.alive():
                continue
            child.reap_group()
            child.last_exit_code = child.process.returncode
            changed = True
            delay = budgets.setdefault(child.name, RestartBudget(policy)).next_delay(now)
            if delay is None:
                return GaveUp(child.name, policy.max_restarts + 1, policy.window_s, child.last_exit_code)
            due[id(child)] = now + delay
            say(f"llmesh: {child.name} exited with code {child.last_exit_code}; restarting in {delay:.1f}s "
                f"(see {child.log_path})")
        if changed and state_path:
            write_state(children, state_path)
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except asyncio.TimeoutError:
            pass
    return None

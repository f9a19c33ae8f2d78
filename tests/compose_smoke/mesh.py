"""The running compose project: compose commands, its containers' state, waiting for health."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.compose_smoke.prepare import COMPOSE_DIR, run

KEY = re.compile(r"llm_[A-Za-z0-9_-]+")
# docker-compose 1.29 on every command while Grafana (left out) has no password file: not the command's output.
NOISE = re.compile(r'^Service "grafana" uses an undefined secret file')


@dataclass
class Ports:
    http: int
    grpc: int
    prometheus: int


class ComposeMesh:
    def __init__(self, compose: list[str], project: str, override: Path, ports: Ports) -> None:
        self.project = project
        self.ports = ports
        self.compose_base = [*compose, "-p", project, "-f", str(COMPOSE_DIR / "compose.yaml"), "-f", str(override)]
        self.env = {**os.environ, "COMPOSE_PROFILES": "cpu", "GATEWAY_PUBLISH_ADDRESS": "127.0.0.1",
                    "GATEWAY_HTTP_PORT": str(ports.http), "GATEWAY_GRPC_PORT": str(ports.grpc),
                    "PROMETHEUS_PORT": str(ports.prometheus)}

    def compose(self, *args: str, capture: bool = False, check: bool = True,
                timeout: float = 1200) -> subprocess.CompletedProcess[str]:
        return run([*self.compose_base, *args], capture=capture, check=check, timeout=timeout, env=self.env)

    def exec(self, service: str, *cmd: str, env: dict[str, str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
        flags = [f for k, v in (env or {}).items() for f in ("-e", f"{k}={v}")]
        out = self.compose("exec", "-T", *flags, service, *cmd, capture=True, check=False, timeout=timeout)
        out.stdout = "".join(line for line in out.stdout.splitlines(keepends=True) if not NOISE.search(line))
        return out

    def containers(self, all_: bool = True) -> list[dict]:
        """docker inspect of the project's containers."""
        ids = run(["docker", "ps", "-q", *(["-a"] if all_ else []), "--filter",
                   f"label=com.docker.compose.project={self.project}"], capture=True).stdout.split()
        if not ids:
            return []
        out = run(["docker", "inspect", *ids], capture=True, check=False)
        if out.returncode == 0:
            return json.loads(out.stdout)
        # A container listed a moment ago can be gone now (compose recreates or removes it while
        # `up` runs beside this poll): inspect one by one and leave the missing ones out.
        found = []
        for one in ids:
            got = run(["docker", "inspect", one], capture=True, check=False)
            if got.returncode == 0:
                found += json.loads(got.stdout)
        return found

    def container(self, service: str) -> dict:
        for c in self.containers():
            if c["Config"]["Labels"].get("com.docker.compose.service") == service:
                return c
        raise LookupError(f"no container for {service}")

    def health(self) -> dict[str, str]:
        """service -> healthy / starting / unhealthy / exited(N) / running (no healthcheck)."""
        out = {}
        for c in self.containers():
            service = c["Config"]["Labels"]["com.docker.compose.service"]
            state = c["State"]
            if state["Status"] == "exited":
                out[service] = f"exited({state['ExitCode']})"
            elif state["Status"] == "restarting" or c.get("RestartCount", 0) >= 2:
                out[service] = f"crash-looping ({c.get('RestartCount', 0)} restarts)"
            else:
                out[service] = (state.get("Health") or {}).get("Status", state["Status"])
        return out

    def wait_healthy(self, services: list[str], timeout: float) -> dict[str, str]:
        """Until every service's container is healthy (one-shots: exited 0); the last state seen."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.health()
            bad = {s: state.get(s, "absent") for s in services
                   if state.get(s) not in ("healthy", "exited(0)")}
            if not bad or time.monotonic() > deadline:
                return bad
            if any(v.startswith(("exited(", "crash-looping")) and v != "exited(0)" or v == "unhealthy"
                   for v in bad.values()):
                return bad
            time.sleep(2)

    def logs(self, service: str, tail: int = 40) -> str:
        try:
            container = self.container(service)["Id"]
        except LookupError:
            return "(no container: compose did not get to create it)"
        return run(["docker", "logs", "--tail", str(tail), container], capture=True, check=False).stdout

    def leftovers(self) -> list[str]:
        """The project's containers, volumes and networks that still exist."""
        label = f"label=com.docker.compose.project={self.project}"
        found = []
        for kind, cmd in (("container", ["docker", "ps", "-aq"]), ("volume", ["docker", "volume", "ls", "-q"]),
                          ("network", ["docker", "network", "ls", "-q"])):
            found += [f"{kind} {x}" for x in run([*cmd, "--filter", label], capture=True).stdout.split()]
        return found

"""`python -m llmesh.gateway --workers 2` refuses to start, with exit status 1 and a JSON
log line saying why, when it cannot run its workers correctly."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from llmesh.testing import free_ports


def gateway(tmp_path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    grpc_port, http_port, metrics_port = free_ports(3)
    base = {**os.environ, "LLMESH_STATE_DIR": str(tmp_path / "state"), "LLMESH_LOCAL_TRUST": "1",
            "LLMESH_CONFIG_BACKEND": "none", "LLMESH_GATEWAY_PORT": str(grpc_port),
            "LLMESH_GATEWAY_HTTP_PORT": str(http_port), "LLMESH_GATEWAY_METRICS_PORT": str(metrics_port),
            "LLMESH_GATEWAY_CACHE_ADDRESS": "", **env}
    return subprocess.run([sys.executable, "-m", "llmesh.gateway", *args], env=base, capture_output=True,
                          text=True, timeout=90, stdin=subprocess.DEVNULL)


def errors(done: subprocess.CompletedProcess) -> list[str]:
    lines = [json.loads(x) for x in done.stderr.splitlines() if x.startswith("{")]
    return [x.get("error", "") for x in lines if x["level"] == "error" and x["msg"] == "cannot start"]


def test_several_workers_without_redis_refuse_to_start(tmp_path):
    done = gateway(tmp_path, {"LLMESH_REDIS_URL": ""}, "--workers", "2")
    assert done.returncode == 1
    assert any("LLMESH_REDIS_URL" in e for e in errors(done)), done.stderr


def test_workers_that_cannot_bind_fail_the_gateway(tmp_path):
    (http_port,) = free_ports(1)
    with socket.socket() as taken:  # a plain listener (no SO_REUSEPORT) holds the HTTP port
        taken.bind(("127.0.0.1", http_port))
        taken.listen()
        done = gateway(tmp_path, {"LLMESH_GATEWAY_WORKERS": "2", "LLMESH_REDIS_URL": "redis://127.0.0.1:1/0",
                                  "LLMESH_GATEWAY_HTTP_PORT": str(http_port)})
    assert done.returncode == 1, done.stderr[-2000:]
    assert any("2 of 2 workers did not start" in e for e in errors(done)), done.stderr[-2000:]

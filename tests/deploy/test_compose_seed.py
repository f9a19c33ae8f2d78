"""The compose mesh's config-seed job, run as compose runs it (its shell command, with
compose's $$ escapes undone) against a real etcd: it writes the seeded live config
once and never replaces a config etcd already holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.deploy.checks import COMPOSE


def _seed(etcd_address: str, seed: Path) -> subprocess.CompletedProcess:
    job = yaml.safe_load(COMPOSE.read_text())["services"]["config-seed"]
    script = job["command"][0].replace("$$", "$").replace("/etc/llmesh/seed.yaml", str(seed))
    env = {**os.environ, **job["environment"], "LLMESH_ETCD_ADDRESS": etcd_address,
           "LLMESH_CONFIG_PREFIX": "/test-compose-seed/config",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([*job["entrypoint"], script], env=env, capture_output=True, text=True, timeout=60)


def _current(etcd_address: str) -> str:
    env = {**os.environ, "LLMESH_CONFIG_BACKEND": "etcd", "LLMESH_ETCD_ADDRESS": etcd_address,
           "LLMESH_CONFIG_PREFIX": "/test-compose-seed/config"}
    llmesh = Path(sys.executable).with_name("llmesh")
    return subprocess.run([str(llmesh), "config", "get"], env=env, capture_output=True, text=True,
                          timeout=60, check=True).stdout


def test_seed_writes_the_config_once(etcd, tmp_path):
    seed = COMPOSE.parent / "llmesh.yaml"
    first = _seed(etcd.address, seed)
    assert first.returncode == 0, first.stderr
    assert "applied as revision" in first.stdout
    assert "max_tokens: 256" in _current(etcd.address)

    other = tmp_path / "other.yaml"
    other.write_text("default: {max_attempts: 3}\n")
    second = _seed(etcd.address, other)
    assert second.returncode == 0, second.stderr
    assert "already holds a config" in second.stdout
    assert "max_tokens: 256" in _current(etcd.address)  # left as it was


def test_seed_fails_when_etcd_is_unreachable(tmp_path):
    from llmesh.testing import free_ports
    (port,) = free_ports(1)
    result = _seed(f"127.0.0.1:{port}", COMPOSE.parent / "llmesh.yaml")
    assert result.returncode != 0

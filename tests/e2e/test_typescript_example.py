"""The TypeScript example (examples/typescript, stubs from protoc-gen-es, gRPC over
HTTP/2 with connect-node), compiled by `make ts-example`, run with node against the
shared mesh's gateway."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import SMOL

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "typescript" / "dist" / "chat.js"


def run_example(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("node") is None or not EXAMPLE.is_file():
        pytest.fail("the TypeScript example is not built: run 'make ts-example' (make test does)")
    return subprocess.run(["node", str(EXAMPLE), *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_the_typescript_example_streams_a_chat(mesh):
    out = run_example(mesh.layout.address("gateway"), SMOL, "What is 2+2?")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "completion tokens]" in out.stderr and ("[STOP;" in out.stderr or "[LENGTH;" in out.stderr)


def test_the_typescript_example_reports_the_status_code(mesh):
    out = run_example(mesh.layout.address("gateway"), "no-such-model", "Hi")
    assert out.returncode == 1
    assert "NotFound" in out.stderr and "no-such-model" in out.stderr

"""`make buf-check` (scripts/buf-check) on a copy of the repository's protos: clean as
they are, and failing on a wire-breaking change (a renumbered field) and on a lint rule
(an undocumented field in the public contract). buf comes from `make buf-check`'s npm
install into .tools/."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / ".tools" / "node_modules" / ".bin" / "buf"
RULES = ROOT / ".tools" / "protovalidate.binpb"


@pytest.fixture
def repo(tmp_path):
    if not BUF.exists() or not RULES.exists():
        pytest.fail("run `make buf-check` first: it installs buf into .tools/")
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "."], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=tmp_path, check=True)
    return tmp_path


def check(repo: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "BUF": str(BUF), "PY": sys.executable, "RULES": str(RULES)}
    return subprocess.run(["bash", str(ROOT / "scripts" / "buf-check")], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)


def edit(repo: Path, name: str, old: str, new: str) -> None:
    path = repo / "protos" / "llmesh" / "v1" / name
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_the_protos_pass(repo):
    out = check(repo)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "buf lint: clean" in out.stdout and "no breaking change against main" in out.stdout


def test_a_renumbered_field_breaks(repo):
    edit(repo, "gateway.proto", "string user = 4", "string user = 40")
    out = check(repo)
    assert out.returncode != 0
    assert 'Previously present field "4" with name "user" on message "ChatRequest" was deleted' in out.stdout


def test_an_undocumented_public_field_fails_lint(repo):
    edit(repo, "gateway.proto", "  // Sampling and length controls; unset fields take the model's defaults.\n", "")
    out = check(repo)
    assert out.returncode != 0 and 'Field "sampling" should have a non-empty comment' in out.stdout

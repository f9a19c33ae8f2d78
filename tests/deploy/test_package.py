"""The image installs llmesh as a built wheel (deploy/docker/Dockerfile: ``pip install .``),
not as the editable install the tests run on: every module of libs/ and services/ must
be in that wheel, or a deployed service fails on its first import."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _wheel_modules(tmp_path: Path) -> set[str]:
    """Built as the image builds it: from a copy of what the Dockerfile copies (a build/
    folder left in the checkout would hide a package missing from the list)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("libs", "services"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, cwd=tmp_path)
    wheel, = (tmp_path / "dist").glob("llmesh-*.whl")
    return {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}


def _expected(root: str, package: str) -> set[str]:
    base = ROOT / root
    return {f"{package}/{p.relative_to(base).as_posix()}" for p in base.rglob("*.py")
            if "__pycache__" not in p.parts and (p.parent / "__init__.py").exists()}


def test_the_wheel_holds_every_module(tmp_path):
    built = _wheel_modules(tmp_path)
    expected = _expected("libs/llmesh", "llmesh") | _expected("services", "llmesh")
    missing = sorted(expected - built)
    assert not missing, f"modules left out of the wheel (add their packages to pyproject.toml): {missing}"

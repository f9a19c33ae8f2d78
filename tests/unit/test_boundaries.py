"""The import boundaries are enforced: an import across one makes lint-imports (make lint) fail,
naming the contract and the import.

Each case lays the installed package out in a temporary folder (scripts/lint-tree, symlinks to
this checkout), replaces one module there by a copy with one forbidden import added, and runs
lint-imports with pyproject.toml's own contracts on it. The checkout itself is never modified."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# (the module given one more import, the import, the contract it breaks, what the report says)
CASES = {
    "a service imports another": (
        "llmesh.scheduler.placement", "import llmesh.engine.core",
        "services never import each other", "llmesh.scheduler.placement -> llmesh.engine.core"),
    "the library imports a service": (
        "llmesh.errors", "from llmesh.cache.keys import Request",
        "libs below services", "llmesh.errors -> llmesh.cache.keys"),
    "the library imports bench": (
        "llmesh.types", "import bench.common",
        "libs and services import no bench code", "llmesh.types -> bench"),
    "a domain module imports grpc": (
        "llmesh.scheduler.placement", "import grpc",
        "domain modules import no gRPC and no transport framework", "llmesh.scheduler.placement -> grpc"),
    "a domain module reaches grpc through a library module": (
        "llmesh.cache.keys", "import llmesh.rpc.status",
        "domain modules import no gRPC and no transport framework", "llmesh.cache.keys -> llmesh.rpc.status"),
}


def lay_out(tree: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "lint-tree"), "--root", str(ROOT), "--tree", str(tree),
                    "true"], check=True)


def add_import(tree: Path, module: str, line: str) -> None:
    """Replaces the module's symlink by a copy with one more import; any symlinked folder on the
    way becomes a real folder of symlinks, so nothing is written through into the checkout."""
    parts = module.split(".")
    here = tree
    for part in parts[:-1]:
        here = here / part
        if here.is_symlink():
            source = here.resolve()
            here.unlink()
            here.mkdir()
            for entry in source.iterdir():
                (here / entry.name).symlink_to(entry)
    path = here / f"{parts[-1]}.py"
    text = path.read_text()
    path.unlink()
    path.write_text(text + f"\n{line}\n")


def lint_imports(tree: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def clean_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("clean") / "tree"
    lay_out(tree)
    return tree


@pytest.mark.parametrize("case", sorted(CASES))
def test_forbidden_import_breaks_its_contract(case: str, clean_tree: Path, tmp_path: Path) -> None:
    module, line, contract, chain = CASES[case]
    tree = tmp_path / "tree"
    shutil.copytree(clean_tree, tree, symlinks=True)
    add_import(tree, module, line)
    result = lint_imports(tree, tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert any(row.startswith(contract) and row.rstrip().endswith("BROKEN") for row in out.splitlines()), out
    assert chain in out, out
    source = (clean_tree / (module.replace(".", "/") + ".py")).resolve()
    assert source.is_relative_to(ROOT) and line not in source.read_text()  # the checkout is untouched


def test_the_layout_is_the_installed_package(clean_tree: Path) -> None:
    """lint-tree lays out what pyproject's package-dir maps: the services under llmesh."""
    assert (clean_tree / "llmesh" / "errors.py").resolve() == ROOT / "libs" / "llmesh" / "errors.py"
    for service in ("gateway", "engine", "modelmgr", "scheduler", "cache"):
        assert (clean_tree / "llmesh" / service).resolve() == ROOT / "services" / service

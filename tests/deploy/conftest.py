"""Fixtures the deploy tests share: the settings' env names, the compose file, and the
charts with their dependencies packaged in a scratch copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.deploy import checks


@pytest.fixture(scope="session")
def allowed_env() -> set[str]:
    return checks.settings_env_names() | checks.otel_env_names()


@pytest.fixture(scope="session")
def compose_doc() -> dict:
    return yaml.safe_load(checks.COMPOSE.read_text())


def _copy_charts(dest: Path) -> Path:
    try:
        checks.helm_binary()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    helm_dir = dest / "helm"
    shutil.copytree(checks.HELM_DIR, helm_dir, ignore=shutil.ignore_patterns("charts", "*.tgz"))
    assert checks.build_dependencies(helm_dir) == []
    return helm_dir


@pytest.fixture(scope="session")
def helm_dir(tmp_path_factory) -> Path:
    """The charts with their dependencies packaged, in a scratch copy (the tree stays clean)."""
    return _copy_charts(tmp_path_factory.mktemp("charts"))


@pytest.fixture
def scratch_charts(tmp_path) -> Path:
    return _copy_charts(tmp_path)

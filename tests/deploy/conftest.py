"""Fixtures the deploy tests share: the settings' env names, the compose file, and the
charts in a scratch copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.deploy import checks, properties


@pytest.fixture(scope="session")
def allowed_env() -> set[str]:
    return checks.settings_env_names() | checks.otel_env_names()


@pytest.fixture(scope="session")
def compose_doc() -> dict:
    return yaml.safe_load(checks.COMPOSE.read_text())


def _copy_charts(dest: Path) -> Path:
    """The charts as a fresh clone holds them: each chart's charts/<dependency> is a committed
    symlink to the sibling chart, so nothing is packaged first (`helm dependency build` is never
    needed) and an edit of llmesh-common reaches every chart at once."""
    try:
        checks.helm_binary()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    return properties.fresh_clone(dest / "helm")


@pytest.fixture(scope="session")
def helm_dir(tmp_path_factory) -> Path:
    """The charts in a scratch copy (the tree stays clean)."""
    return _copy_charts(tmp_path_factory.mktemp("charts"))


@pytest.fixture(scope="module")
def umbrella(helm_dir) -> list[dict]:
    """The umbrella chart rendered with its defaults (release "prod")."""
    docs, problems = checks.render(helm_dir / "llmesh", [], release="prod")
    assert problems == []
    return docs


@pytest.fixture
def scratch_charts(tmp_path) -> Path:
    return _copy_charts(tmp_path)

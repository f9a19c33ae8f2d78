"""Parsing and rendering config documents (YAML or JSON text)."""

from __future__ import annotations

import difflib

import yaml
from pydantic import ValidationError

from llmesh.liveconfig.schema import MeshConfig


class InvalidConfig(ValueError):
    pass


def parse(text: str | bytes) -> MeshConfig:
    """Text -> validated config; InvalidConfig says every problem found."""
    try:
        data = yaml.safe_load(text) if text else {}
    except yaml.YAMLError as exc:
        raise InvalidConfig(f"not YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InvalidConfig(f"the document must be a mapping, got {type(data).__name__}")
    try:
        return MeshConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
                             for e in exc.errors(include_url=False))
        raise InvalidConfig(problems) from None


def render(config: MeshConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True), sort_keys=True)


def diff(old: MeshConfig, new: MeshConfig, old_name: str = "current", new_name: str = "new") -> str:
    return "".join(difflib.unified_diff(render(old).splitlines(True), render(new).splitlines(True),
                                        old_name, new_name))

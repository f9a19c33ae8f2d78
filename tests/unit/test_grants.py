"""Grants: tenant and group model lists, max_tokens caps, priority classes."""

from __future__ import annotations

from llmesh.liveconfig.schema import MeshConfig
from llmesh.types import Priority
from llmesh.gateway.context import Caller
from llmesh.gateway.stages.grants import access

CONFIG = MeshConfig.model_validate({
    "tenants": {"acme": {"models": ["small"], "max_tokens": 64, "priority": "low"},
                "*": {"models": []}},
    "groups": {"eng": {"models": ["big"], "max_tokens": 256, "priority": "high"},
               "ops": {"models": None}},
})


def test_tenant_grant():
    a = access(CONFIG, Caller(tenant="acme"))
    assert a.allows("small") and not a.allows("big")
    assert (a.max_tokens, a.priority) == (64, Priority.LOW)


def test_groups_widen_the_grant():
    a = access(CONFIG, Caller(tenant="acme", groups=("eng", "unknown")))
    assert a.allows("small") and a.allows("big")
    assert (a.max_tokens, a.priority) == (256, Priority.HIGH)
    assert access(CONFIG, Caller(tenant="acme", groups=("ops",))).models is None


def test_a_key_narrows_the_grant():
    a = access(CONFIG, Caller(tenant="acme", groups=("eng",), models=("big", "other")))
    assert a.allows("big") and not a.allows("small") and not a.allows("other")


def test_unknown_tenants_take_the_wildcard_and_no_config_allows_all():
    assert not access(CONFIG, Caller(tenant="stranger")).allows("small")
    open_access = access(MeshConfig(), Caller(tenant="stranger"))
    assert open_access.models is None and open_access.priority == Priority.NORMAL

"""What a caller may do: the tenant's grant widened by its groups' grants,
narrowed by the API key's own model list (all from live config). A key or a JWT
naming a tenant the config does not list is refused (403 unknown_tenant) unless a
``"*"`` tenant grants any other tenant; only local mode's caller gets the open grant."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from llmesh.errors import PermissionDenied
from llmesh.liveconfig.schema import MeshConfig, TenantPolicy
from llmesh.types import Priority
from llmesh.gateway.context import Caller, Context
from llmesh.gateway.stages.base import Stage

PRIORITIES = {"low": Priority.LOW, "normal": Priority.NORMAL, "high": Priority.HIGH}


@dataclass(frozen=True, slots=True)
class Access:
    models: frozenset[str] | None  # None: every model
    max_tokens: int | None
    priority: Priority

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


def _tenant(config: MeshConfig, caller: Caller) -> TenantPolicy:
    if caller.method != "local" and caller.tenant not in config.tenants and "*" not in config.tenants:
        raise PermissionDenied(f"The tenant '{caller.tenant}' is not known to this gateway.",
                               reason="unknown_tenant")
    return config.tenant(caller.tenant)


def access(config: MeshConfig, caller: Caller) -> Access:
    tenant = _tenant(config, caller)
    grants = [tenant, *(config.groups[g] for g in caller.groups if g in config.groups)]
    models: set[str] | None
    named: set[str] = set()
    for grant in grants:
        if grant.models is None:  # a grant without a list: every model
            models = None
            break
        named |= set(grant.models)
    else:
        models = named
    if caller.models is not None:
        models = set(caller.models) if models is None else models & set(caller.models)
    caps = [g.max_tokens for g in grants if g.max_tokens is not None]
    max_tokens = None if len(caps) < len(grants) else max(caps)  # a group without a cap lifts it
    levels = [PRIORITIES[g.priority] for g in grants if g.priority is not None]
    return Access(models=None if models is None else frozenset(models),
                  max_tokens=max_tokens, priority=max(levels, default=Priority.NORMAL))


class AuthorizeStage(Stage):
    """403 for a model outside the grant; caps max_tokens; sets the priority class."""

    def __init__(self, config: Callable[[], MeshConfig]):
        self._config = config

    async def admit(self, ctx: Context) -> None:
        req = ctx.req
        grant = access(self._config(), req.caller)
        if not grant.allows(req.model):
            raise PermissionDenied(f"The tenant '{req.tenant}' may not use the model '{req.model}'.",
                                   reason="model_not_allowed", param="model")
        sampling = req.sampling
        if grant.max_tokens is not None:
            if sampling.max_tokens is not None and sampling.max_tokens > grant.max_tokens:
                raise PermissionDenied(
                    f"max_tokens {sampling.max_tokens} is over this tenant's limit of {grant.max_tokens}.",
                    reason="max_tokens_not_allowed", param="max_tokens")
            if sampling.max_tokens is None:
                sampling = replace(sampling, max_tokens=grant.max_tokens)
        priority = Priority.LOW if req.on_behalf is not None else grant.priority  # a batch line: the lowest
        if sampling is not req.sampling or priority != req.priority:  # a copy only for a change
            ctx.req = replace(req, sampling=sampling, priority=priority)

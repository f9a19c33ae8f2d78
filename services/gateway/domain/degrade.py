"""Degradation under load (the live config's ``degradation``): which policies a request gets
once its model is saturated. Pure: the stage (stages/degrade.py) measures the loads and
applies the verdict.

A model's load is what flow control sees of its endpoints: requests in flight there plus
those waiting in the gateway, over the endpoints' slots (1.0: every slot busy). At or past a
rule's ``saturation`` the rule applies:

- ``max_tokens``: a request asking for more (or for no limit) gets the cap;
- ``variant``: the smaller model answers instead, when it can now (a provider serves it, or it
  has endpoints: not one scaled to zero) and it is less loaded than the model (a variant as
  saturated helps no one);
- ``cache_similarity``: the semantic cache may answer at this looser threshold; applied (and
  named) only when a hit below the cache's own threshold serves the request.

A policy that would change nothing is not applied, so the response names only what was done."""

from __future__ import annotations

from dataclasses import dataclass

from llmesh.liveconfig.schema import Degradation

MAX_TOKENS = "max_tokens"
VARIANT = "variant"
CACHE = "cache"


@dataclass(frozen=True, slots=True)
class Verdict:
    policies: tuple[str, ...]  # applied, in a fixed order: variant, max_tokens
    model: str  # the model that answers
    max_tokens: int | None  # the request's max_tokens after the cap
    cache_similarity: float | None = None  # a looser semantic threshold the cache may answer at


def choose(rule: Degradation | None, model: str, load: float | None, max_tokens: int | None,
           variant_known: bool = False, variant_load: float | None = None) -> Verdict | None:
    """The policies of ``rule`` that apply to a request for ``model`` (at ``load``; None: not
    measured, no endpoint known) asking for ``max_tokens``; None: none apply. ``variant_known``:
    the rule's variant can answer now; ``variant_load``: its load (None: not measured,
    e.g. a provider's model)."""
    if rule is None or load is None or load < rule.saturation:
        return None
    policies: list[str] = []
    answering = model
    if rule.variant is not None and variant_known and (variant_load is None or variant_load < load):
        policies.append(VARIANT)
        answering = rule.variant
    capped = max_tokens
    if rule.max_tokens is not None and (max_tokens is None or max_tokens > rule.max_tokens):
        policies.append(MAX_TOKENS)
        capped = rule.max_tokens
    loose = rule.cache_similarity
    return Verdict(tuple(policies), answering, capped, loose) if policies or loose is not None else None


def load_of(free: int, total: int, waiting: int) -> float | None:
    """A model's load from its endpoints' slots (``free`` of ``total``) and the requests waiting
    for one in the gateway; None when it has no slots known."""
    if total <= 0:
        return None
    return (total - free + waiting) / total

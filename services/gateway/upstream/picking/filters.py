"""Filters: each drops endpoints that must not get the request."""

from __future__ import annotations

from typing import Protocol

from llmesh.gateway.upstream.picking.types import Endpoint, LocalState, PickInput


class Filter(Protocol):
    name: str

    def keep(self, e: Endpoint, req: PickInput, local: LocalState) -> bool:
        """Whether ``e`` may get the request."""
        ...


class ServesModel:
    """The model (or LoRA adapter, which engines list among their models) is loaded there, for
    what the request asks: an embeddings request only where it is an embedding model, a
    generative request only where it is not, and one that needs tool calling only where the
    engine's backend calls tools."""
    name = "serves_model"

    def keep(self, e: Endpoint, req: PickInput, local: LocalState) -> bool:
        return req.model in e.models and (req.model in e.embeds) == req.embed and (not req.tools
                                                                                     or req.model in e.tools)


class Healthy:
    """The scheduler hears from it and it is not draining."""
    name = "healthy"

    def keep(self, e: Endpoint, req: PickInput, local: LocalState) -> bool:
        return e.healthy


class NotDegraded:
    """Its node shows no ECC errors rising, failed self-test or drifting latency. A preference,
    as Envoy treats degraded hosts: a degraded endpoint gets a request only when no other one
    that passes the filters can take it (a slow answer beats a 503)."""
    name = "not_degraded"

    def keep(self, e: Endpoint, req: PickInput, local: LocalState) -> bool:
        return not e.degraded


class NotTried:
    """Not already tried for this request."""
    name = "not_tried"

    def keep(self, e: Endpoint, req: PickInput, local: LocalState) -> bool:
        return e.endpoint_id not in req.exclude


class BreakerClosed:
    """It has not refused a connection from this gateway within the last few seconds."""
    name = "breaker_closed"

    def keep(self, e: Endpoint, req: PickInput, local: LocalState) -> bool:
        return local.down_until.get(e.endpoint_id, 0.0) <= req.now


FILTERS: tuple[Filter, ...] = (ServesModel(), Healthy(), NotTried(), BreakerClosed())
# Always applied after FILTERS, each narrowing the set but never emptying it.
PREFERENCES: tuple[Filter, ...] = (NotDegraded(),)


class ContextFits:
    """The request's prompt plus the completion it asks for fits the context the engine
    reported for the model (unknown: it may). Optional, chosen per model in live config;
    a preference: when it would drop every candidate, it drops none, and the engine's
    own check refuses the request (context_length_exceeded: the next model in the
    fallback chain, or a 400)."""
    name = "context_fits"

    def keep(self, e: Endpoint, req: PickInput, local: LocalState) -> bool:
        ctx = e.context.get(req.model)
        return not ctx or req.context_tokens() <= ctx


OPTIONAL_FILTERS = {f.name: f for f in (ContextFits(),)}
# The optional filters that read the prompt's tokens (a pick under them tokenizes first).
PROMPT_FILTERS: tuple[str, ...] = (ContextFits.name,)

"""The model list (GET /v1/models, gRPC ListModels): only names a request can be answered
for now, each with what it serves. A name is listed when a healthy endpoint serves it, a
provider maps it, or the autoscaler scales it (a request for it waits for a replica); a
model whose policy falls back to a listed one, a cascade either of whose models is
listed, and a split all of whose targets are listed are listed too. A registered model
no engine serves is not: every request for it would be 503.

An embedding model (its engines serve Embed, not Generate) serves ``embeddings`` only, and
so does a split all of whose targets are embedding models; the list names the generative
models first, then the embedding ones, each sorted by name: a client that takes the first
model can chat with it. Pure: the caller passes the config and the healthy endpoints' models."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from enum import Enum

from llmesh.liveconfig.schema import MeshConfig


class Serves(str, Enum):
    """An API a listed model answers."""
    CHAT = "chat"                # POST /v1/chat/completions, gRPC Chat
    COMPLETIONS = "completions"  # POST /v1/completions, gRPC Complete
    EMBEDDINGS = "embeddings"    # POST /v1/embeddings, gRPC Embed


# What generative engine backends and every OpenAI-compatible provider answer; embedding models
# (the minilm backend) answer EMBEDDING.
GENERATIVE: tuple[Serves, ...] = (Serves.CHAT, Serves.COMPLETIONS)
EMBEDDING: tuple[Serves, ...] = (Serves.EMBEDDINGS,)
OWNER = "llmesh"


@dataclass(frozen=True, slots=True)
class ListedModel:
    name: str
    serves: tuple[Serves, ...]
    owned_by: str  # "llmesh" for engines and aliases; a provider's name for a model it maps


def listed_models(config: MeshConfig, served: Iterable[str], embedding: Collection[str] = frozenset()
                  ) -> list[ListedModel]:
    """The names a request can be answered for: generative ones first, then those in (or split
    over) ``embedding`` (the served models that are embedding models), each sorted by name."""
    direct: dict[str, str] = {name: OWNER for name in served}
    for name in config.autoscaling.models:
        direct.setdefault(name, OWNER)
    for provider, p in config.providers.items():
        for name in p.models:
            direct.setdefault(name, provider)
    # A model (served or not) answered through its fallbacks; fallbacks are not followed further.
    reachable = dict(direct)
    for name, policy in config.models.items():
        if name not in reachable and any(f in direct for f in policy.fallbacks):
            reachable[name] = OWNER
    for alias, split in config.splits.items():
        if all(t.model in reachable for t in split.targets):
            reachable[alias] = OWNER
    for alias, cascade in config.cascades.items():
        if cascade.cheap in reachable or cascade.strong in reachable:
            reachable[alias] = OWNER
    embeds = {name for name in reachable if name in embedding and config.provider_for(name) is None} | {
        alias for alias, split in config.splits.items()
        if alias in reachable and all(t.model in embedding for t in split.targets)}
    return sorted((ListedModel(name, EMBEDDING if name in embeds else GENERATIVE, owner)
                   for name, owner in reachable.items()), key=lambda m: (m.serves == EMBEDDING, m.name))

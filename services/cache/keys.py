"""Exact-match cache keys. Only deterministic requests (temperature 0) are cacheable:
the same key must always mean the same answer."""

from __future__ import annotations

import hashlib

import orjson

from llmesh.types import Prompt, Sampling


def cacheable(sampling: Sampling) -> bool:
    return sampling.cacheable


def exact_key(tenant: str, model: str, prompt: Prompt, sampling: Sampling) -> str:
    """A digest of everything that shapes a greedy answer. The seed is left out: at
    temperature 0 it changes nothing. The tenant is in: tenants never share entries."""
    doc = {
        "t": tenant,
        "m": model,
        "c": [[m.role, m.content] for m in prompt.messages] if prompt.messages is not None else None,
        "p": prompt.text,
        "n": sampling.max_tokens,
        "s": list(sampling.stop),
        "f": [sampling.response_format.type, sampling.response_format.schema] if sampling.response_format else None,
    }
    return hashlib.sha256(orjson.dumps(doc)).hexdigest()

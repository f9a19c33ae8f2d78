"""What the live config does to a request, as pure functions: an alias becomes a real
model (weighted split, sticky per user), and the model's policy fills in what the
request left unset (generation defaults, system prompt)."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from llmesh.liveconfig.schema import MeshConfig, ModelPolicy, TrafficSplit
from llmesh.types import Message, Prompt, Sampling


def pick_target(split: TrafficSplit, key: str) -> str:
    """A weighted choice that is stable for one key (user), so A/B arms don't flip."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    point = int.from_bytes(digest, "big") / 2**64 * sum(t.weight for t in split.targets)
    for target in split.targets:
        point -= target.weight
        if point < 0:
            return target.model
    return split.targets[-1].model


def route(model: str, config: MeshConfig, key: str) -> tuple[str, ModelPolicy]:
    split = config.splits.get(model)
    target = pick_target(split, key) if split is not None else model
    return target, config.policy(target)


def apply_policy(prompt: Prompt, sampling: Sampling, policy: ModelPolicy) -> tuple[Prompt, Sampling]:
    gen = policy.generation
    temperature = sampling.temperature if sampling.temperature is not None else gen.temperature
    top_p = sampling.top_p if sampling.top_p is not None else gen.top_p
    max_tokens = sampling.max_tokens if sampling.max_tokens is not None else gen.max_tokens
    if (temperature, top_p, max_tokens) != (sampling.temperature, sampling.top_p, sampling.max_tokens):
        sampling = replace(sampling, temperature=temperature, top_p=top_p, max_tokens=max_tokens)
    if policy.system_prompt and prompt.messages is not None and not any(
            m.role == "system" for m in prompt.messages):
        prompt = Prompt(messages=(Message("system", policy.system_prompt), *prompt.messages))
    return prompt, sampling

"""The run-time configuration of the whole mesh, validated as one document. An
invalid document is rejected as a whole; nothing in it is applied."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GenerationDefaults(_Strict):
    """Applied to a request's unset fields."""
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)


class ModelPolicy(_Strict):
    routing: Literal["least_loaded", "random"] = "least_loaded"
    max_attempts: int = Field(default=2, ge=1, le=10, description="engines tried before the first token")
    generation: GenerationDefaults = GenerationDefaults()
    system_prompt: str | None = Field(default=None, description="prepended when the request has none")


class SplitTarget(_Strict):
    model: str = Field(min_length=1)
    weight: float = Field(gt=0)


class TrafficSplit(_Strict):
    """An alias clients call, spread over real models by weight (A/B, canary)."""
    targets: list[SplitTarget] = Field(min_length=1)
    shadow: str | None = Field(default=None, description="also send a copy here; its answer is dropped")


class RateLimit(_Strict):
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_concurrency: int | None = Field(default=None, ge=1)


class CacheConfig(_Strict):
    enabled: bool = True
    ttl_s: float = Field(default=3600, gt=0)
    semantic_threshold: float = Field(default=0.95, gt=0, le=1)


class CircuitBreaker(_Strict):
    failure_threshold: int = Field(default=5, ge=1)
    reset_after_s: float = Field(default=10, gt=0)


class MeshConfig(_Strict):
    default: ModelPolicy = ModelPolicy()
    models: dict[str, ModelPolicy] = {}
    splits: dict[str, TrafficSplit] = {}
    rate_limits: dict[str, RateLimit] = Field(default={}, description="per tenant")
    cache: CacheConfig = CacheConfig()
    circuit_breaker: CircuitBreaker = CircuitBreaker()

    @model_validator(mode="after")
    def _aliases_are_not_models(self) -> MeshConfig:
        both = set(self.splits) & set(self.models)
        if both:
            raise ValueError(f"names used both as a split alias and a model: {sorted(both)}")
        for alias, split in self.splits.items():
            if any(t.model == alias for t in split.targets):
                raise ValueError(f"split '{alias}' targets itself")
        return self

    def policy(self, model: str) -> ModelPolicy:
        return self.models.get(model, self.default)

"""The run-time configuration of the whole mesh, validated as one document. An
invalid document is rejected as a whole; nothing in it is applied."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmesh.netaddr import is_loopback


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GenerationDefaults(_Strict):
    """Applied to a request's unset fields."""
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)


class ModelPolicy(_Strict):
    routing: Literal["least_loaded", "random", "round_robin", "token_aware", "prefix_aware",
                     "session_affinity"] = Field(default="least_loaded", description="how an endpoint is picked")
    scorers: dict[Literal["least_load", "token_aware", "prefix_aware", "session_affinity", "round_robin",
                          "lora_affinity", "token_load", "kv_cost", "sticky_affinity"],
                  float] = Field(default={}, description="scorer weights (>= 0); set: replace the routing's own")
    filters: list[Literal["context_fits"]] = Field(default=[], description="optional endpoint filters, in "
                                                   "order; each narrows the candidates unless none would pass")
    max_attempts: int = Field(default=2, ge=1, le=10, description="engines tried before the first token")
    fallbacks: list[str] = Field(default=[], description="models tried in order when this one cannot answer "
                                 "before the first token (no healthy endpoint, failures, prompt too long)")
    generation: GenerationDefaults = GenerationDefaults()
    system_prompt: str | None = Field(default=None, description="prepended when the request has none")


    @model_validator(mode="after")
    def _weights_are_not_negative(self) -> ModelPolicy:
        bad = {k: w for k, w in self.scorers.items() if w < 0}
        if bad:
            raise ValueError(f"scorer weights must be >= 0: {bad}")
        return self


class SplitTarget(_Strict):
    model: str = Field(min_length=1)
    weight: float = Field(gt=0)


class TrafficSplit(_Strict):
    """An alias clients call, spread over real models by weight (A/B, canary)."""
    targets: list[SplitTarget] = Field(min_length=1)


class RateLimit(_Strict):
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_concurrency: int | None = Field(default=None, ge=1)


class Budget(_Strict):
    """Spending allowed per period; a request is admitted while the period's spend
    plus what in-flight requests reserved is under the line (so at most one
    request ends past it)."""
    period: Literal["day", "month"] = "day"
    tokens: int | None = Field(default=None, ge=1, description="input + output tokens per period")
    usd: float | None = Field(default=None, gt=0, description="money per period, at the models' prices")


class Guards(_Strict):
    """What the gateway does with a prompt before it leaves for the engine."""
    pii: Literal["mask", "off"] = "mask"
    restore: bool = Field(default=False, description="put the masked values back into the answer")
    output_pii: Literal["mask", "off"] = Field(
        default="off", description="mask PII the model writes; streamed, each word is held until the next "
        "token shows it is no e-mail address (its first token is a decode step later)")
    injection: Literal["block", "flag", "off"] = "flag"
    injection_threshold: float = Field(default=0.6, gt=0, le=1, description="score at which the screen acts")


class Grant(_Strict):
    """What a tenant or a group may do. ``models`` lists model names and split
    aliases; None allows every model."""
    models: list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1, description="cap on a request's max_tokens")
    priority: Literal["low", "normal", "high"] | None = None


class TenantPolicy(Grant):
    budget: Budget | None = None
    guards: Guards = Guards()
    weight: float = Field(default=1.0, gt=0, le=1000, description="share of a model's served tokens under "
                          "contention (flow_control), relative to the other tenants waiting")


class Price(_Strict):
    input_per_1k: float = Field(default=0, ge=0, description="money per 1,000 input tokens")
    output_per_1k: float = Field(default=0, ge=0, description="money per 1,000 output tokens")


class CacheEmbedder(_Strict):
    """The semantic cache's embedder: ``local``, a sentence-transformers model directory (BERT, mean
    pooling) beside the cache's default one (``LLMESH_CACHE_EMBED_MODEL_DIR``, MiniLM); or ``openai``,
    an OpenAI-compatible ``/v1/embeddings`` endpoint (a provider, llmesh's own gateway). Its key is
    never in the config: it is read from ``api_key_env`` or ``api_key_file``, which the cache accepts
    only from its own allow-list and key directory. The embedder's name and version (a URL's: its model
    name and the dimension it returns) are part of every semantic scope: changing it starts a fresh
    index, and no entry embedded by another is ever served."""
    kind: Literal["local", "openai"] = "local"
    model: str | None = Field(default=None, max_length=200, description="local: a directory's name beside the "
                              "default model's (none: the default); openai: the model name sent")
    base_url: str | None = Field(default=None, description="openai: up to /v1, e.g. https://api.openai.com/v1")
    api_key_env: str | None = None
    api_key_file: str | None = None
    timeout_s: float = Field(default=0.5, gt=0, le=10, description="openai: per call; over it the lookup misses")

    @model_validator(mode="after")
    def _coherent(self) -> CacheEmbedder:
        if self.kind == "local":
            if self.base_url is not None or self.api_key_env is not None or self.api_key_file is not None:
                raise ValueError("a local embedder takes no base_url or key")
            if self.model is not None and (not self.model or "/" in self.model or self.model.startswith(".")):
                raise ValueError("a local embedder's model is a directory name, without '/' or a leading '.'")
            return self
        if self.base_url is None or not self.model:
            raise ValueError("an openai embedder needs base_url and model")
        problem = url_problem(self.base_url)
        if problem:
            raise ValueError(problem)
        return self


class CacheVerifier(_Strict):
    """A judge for semantic candidates: when enabled, the nearest entries at or above
    ``candidate_threshold`` (recall-oriented, instead of ``semantic_threshold``) that pass every
    guard are put, one by one (at most ``max_candidates``), to a model behind an OpenAI-compatible
    ``/v1/chat/completions`` as a constrained yes/no question; only a yes within ``timeout_s`` serves
    the entry (no, a timeout or an error: the next candidate, then a miss). The judge sees both
    (PII-masked) questions. Its key as the embedder's: an allow-listed variable or the key directory."""
    enabled: bool = False
    base_url: str | None = Field(default=None, description="up to /v1; llmesh's own gateway or a provider")
    model: str | None = Field(default=None, max_length=200)
    api_key_env: str | None = None
    api_key_file: str | None = None
    candidate_threshold: float = Field(default=0.7, gt=0, le=1, description="cosine; candidates go to the judge")
    timeout_s: float = Field(default=0.25, gt=0, le=10, description="per judgement; over it the candidate misses")
    max_candidates: int = Field(default=2, ge=1, le=8, description="judged per lookup, best first")

    @model_validator(mode="after")
    def _coherent(self) -> CacheVerifier:
        if self.enabled and (self.base_url is None or not self.model):
            raise ValueError("an enabled verifier needs base_url and model")
        problem = url_problem(self.base_url) if self.base_url is not None else None
        if problem:
            raise ValueError(problem)
        return self


class CacheConfig(_Strict):
    enabled: bool = True
    ttl_s: float = Field(default=3600, gt=0)
    semantic_threshold: float = Field(default=0.85, gt=0, le=1, description="cosine; the guards apply on top")
    mode: Literal["exact", "semantic"] = Field(default="exact", description="semantic: exact first, then nearest")
    cache_sampled: bool = Field(default=False, description="also cache sampling requests (temperature > 0, no seed)")
    models: dict[str, CacheRule] = Field(default={}, description="per model (the route a request takes)")
    tenants: dict[str, CacheRule] = Field(default={}, description="per tenant; wins over the model's rule")
    embedder: CacheEmbedder = CacheEmbedder()
    verifier: CacheVerifier = CacheVerifier()

    def policy(self, tenant: str, model: str) -> CachePolicy:
        """The default, then the model's rule, then the tenant's."""
        fields = {name: getattr(self, name) for name in CachePolicy.model_fields}
        for rule in (self.models.get(model), self.tenants.get(tenant)):
            if rule is not None:
                fields.update(rule.model_dump(exclude_none=True))
        return CachePolicy.model_construct(**fields)  # every value was validated already

    def applies(self, tenant: str, model: str, deterministic: bool) -> bool:
        """Whether a request of this tenant for this model goes through the cache
        (on the gateway's request path: no model built)."""
        enabled, sampled = self.enabled, self.cache_sampled
        for rule in (self.models.get(model), self.tenants.get(tenant)):
            if rule is not None:
                enabled = enabled if rule.enabled is None else rule.enabled
                sampled = sampled if rule.cache_sampled is None else rule.cache_sampled
        return enabled and (deterministic or sampled)


class CacheRule(_Strict):
    """A model's or a tenant's cache overrides; unset fields keep the level below."""
    enabled: bool | None = None
    ttl_s: float | None = Field(default=None, gt=0)
    semantic_threshold: float | None = Field(default=None, gt=0, le=1)
    mode: Literal["exact", "semantic"] | None = None
    cache_sampled: bool | None = None


class CachePolicy(_Strict):
    """What applies to one (tenant, model)."""
    enabled: bool
    ttl_s: float
    semantic_threshold: float
    mode: Literal["exact", "semantic"]
    cache_sampled: bool


class CircuitBreaker(_Strict):
    """Per endpoint: opens on ``failure_threshold`` failures in a row, or when the last
    ``window_s`` seconds hold ``min_requests`` or more attempts and more than
    ``error_rate`` of them failed or their p99 time to first token exceeds
    ``latency_p99_s``. After ``reset_after_s`` one probe is let through (half-open):
    its success closes the breaker, its failure opens it again."""
    enabled: bool = True
    failure_threshold: int = Field(default=5, ge=1)
    reset_after_s: float = Field(default=10, gt=0)
    window_s: float = Field(default=30, gt=0)
    min_requests: int = Field(default=10, ge=1)
    error_rate: float = Field(default=0.2, gt=0, le=1)
    latency_p99_s: float = Field(default=5.0, gt=0)


class RetryBudget(_Strict):
    """Retries before the first token (on another endpoint or a fallback model) are
    paid from a budget that each request adds ``ratio`` to, holding at most ``burst``:
    a failing fleet sees at most ratio x requests + burst extra attempts."""
    ratio: float = Field(default=0.2, ge=0, le=1)
    burst: float = Field(default=10, ge=0)


class Provider(_Strict):
    """An external OpenAI-compatible HTTP API. Its key is never in the config: it is read
    at call time from ``api_key_env`` or ``api_key_file`` (neither: no key sent), which the
    gateway accepts only from its own allow-list and key directory. ``base_url`` is https;
    plain http only to a loopback host (the key and prompts cross no network in clear)."""
    base_url: str = Field(description="up to /v1, e.g. https://api.openai.com/v1")
    api_key_env: str | None = None
    api_key_file: str | None = None
    models: dict[str, str] = Field(description="our model name -> the provider's model name")

    @model_validator(mode="after")
    def _url_is_safe(self) -> Provider:
        problem = url_problem(self.base_url)
        if problem:
            raise ValueError(problem)
        return self


def url_problem(base_url: str) -> str | None:
    """Why a provider's ``base_url`` may not be called (None: it may): https to any host,
    http only to a loopback host (``localhost`` or a loopback address), nothing else, and
    no user or password in the URL."""
    try:
        url = urlsplit(base_url)
        host = url.hostname or ""
        has_user = url.username is not None or url.password is not None
    except ValueError:
        return f"base_url is not a URL: {base_url!r}"
    if not host:
        return f"base_url has no host: {base_url!r}"
    if has_user:
        return "base_url must not hold a user or password (use api_key_file or api_key_env)"
    if url.scheme == "https" or (url.scheme == "http" and is_loopback(host)):
        return None
    if url.scheme == "http":
        return f"base_url must be https:// (plain http only to a loopback host, not {host!r})"
    return f"base_url must be https:// (got {url.scheme or 'no'} scheme)"


class Autoscale(_Strict):
    """How the scheduler sizes one model's fleet (services/scheduler/autoscale.py).
    Waiting requests are the engines' queues plus requests the gateways hold for a
    model with no ready replica."""
    min_replicas: int = Field(default=0, ge=0, description="0: scale to zero when idle")
    max_replicas: int = Field(default=4, ge=1)
    waiting_per_replica: float = Field(default=5, gt=0, description="more waiting than this per replica: scale up")
    max_wait_s: float = Field(default=30, gt=0, description="a request held longer than this: one more replica "
                              "(at most one per this many seconds)")
    idle_s: float = Field(default=600, gt=0, description="nothing running or waiting this long: down to "
                          "min_replicas")
    cooldown_s: float = Field(default=300, ge=0, description="no scale-down sooner than this after a change")

    @model_validator(mode="after")
    def _min_is_not_above_max(self) -> Autoscale:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        return self


class Autoscaling(_Strict):
    models: dict[str, Autoscale] = Field(default={}, description="the models the scheduler scales; others "
                                         "keep the replicas they have")
    hold_s: float = Field(default=60, gt=0, le=600, description="a gateway holds a request for a scaled model "
                          "with no ready replica this long (within the request's deadline), then answers 503")
    retry_after_s: int = Field(default=5, ge=1, description="the Retry-After of that 503")


class Shadow(_Strict):
    """Copies of an alias's requests sent, after the primary answered, to another model
    version; both answers are compared and recorded (``llmesh shadow report``). A copy
    never delays the primary's answer; past ``max_concurrency`` copies in flight (per
    alias, per gateway) new copies are dropped and counted."""
    model: str = Field(min_length=1, description="the shadow version: a model or a provider-mapped model")
    sample: float = Field(default=1.0, gt=0, le=1, description="share of requests copied")
    max_concurrency: int = Field(default=4, ge=1, le=1024, description="copies in flight at most")


class Cascade(_Strict):
    """An alias answered by ``cheap`` first; when that answer's confidence (the mean
    log probability of its tokens) is under ``min_confidence`` it is thrown away and
    ``strong`` answers instead. Streams are held until the decision is made."""
    cheap: str = Field(min_length=1)
    strong: str = Field(min_length=1)
    min_confidence: float = Field(le=0, description="mean token logprob (<= 0) an answer needs to be kept")

    @model_validator(mode="after")
    def _two_models(self) -> Cascade:
        if self.cheap == self.strong:
            raise ValueError("a cascade's cheap and strong models must differ")
        return self


class FlowClass(_Strict):
    """A priority class under flow control (grants' priority: high = critical, normal =
    standard, low = batch, the Batch API's and shadow copies' class)."""
    reserved_share: float = Field(default=0.0, ge=0, lt=1, description="share of a model's engine slots held for "
                                  "this class while it does not use them")
    promote_after_s: float | None = Field(default=None, gt=0, description="a request queued this long in the "
                                          "class moves up one class; unset: never")


ClassName = Literal["critical", "standard", "batch"]


def _flow_classes() -> dict[ClassName, FlowClass]:
    return {"critical": FlowClass(reserved_share=0.2), "standard": FlowClass(promote_after_s=30),
            "batch": FlowClass(promote_after_s=120)}


class FlowControl(_Strict):
    """Requests wait in the gateway, per tenant, when every engine that could serve them is
    saturated (running + waiting at its capacity), and are released in token-weighted fair
    order as capacity frees, instead of a 429 at once."""
    enabled: bool = Field(default=False, description="off: a saturated model's requests get 429 queue_full at once")
    max_queued_per_tenant: int = Field(default=256, ge=1, le=100_000, description="requests of one tenant waiting "
                                       "per model; more get 429 (tenant_queue_full)")
    max_queued: int = Field(default=4096, ge=1, le=1_000_000, description="requests waiting per model; more shed "
                            "a lower class's newest, or the longest queue's, or get 429 (queue_full)")
    engine_queue: int = Field(default=0, ge=0, le=10_000, description="requests per endpoint sent on past its "
                              "running slots into its own queue (at most its max_waiting): its capacity")
    default_output_tokens: int = Field(default=256, ge=1, description="expected output tokens of a request that "
                                       "sets no max_tokens (its cost in the fair order)")
    burst_tokens: int = Field(default=2048, ge=0, le=10_000_000, description="tokens a tenant with nothing waiting "
                              "may go ahead of the backlogged ones (per weight): a quiet tenant's burst is served "
                              "first; 0: strict start-time fair queueing")
    quiet_share: float = Field(default=0.0, ge=0, lt=1, description="share of a model's engine slots only a "
                               "request whose tenant has nothing waiting may take: a light tenant's request finds "
                               "a slot at once behind a flood (those slots idle otherwise)")
    classes: dict[ClassName, FlowClass] = Field(default_factory=_flow_classes, description="each class's reserved "
                                                "share and promotion; a class left out has neither")

    @model_validator(mode="after")
    def _reservations_leave_room(self) -> FlowControl:
        if sum(c.reserved_share for c in self.classes.values()) >= 1:
            raise ValueError("flow_control classes' reserved_share must add up to less than 1")
        return self


class Degradation(_Strict):
    """What a model's requests of one class get once the model is saturated, instead of a
    wait or a refusal: a cap on ``max_tokens``, a smaller variant model, a semantic cache hit at a
    looser threshold, or several. The response names the policies applied (``x-llmesh-degraded``)."""
    saturation: float = Field(default=1.0, gt=0, le=100, description="applies at or past this load: requests "
                              "in flight at the model's endpoints plus those waiting in the gateway, over its engine "
                              "slots (1: every slot busy)")
    max_tokens: int | None = Field(default=None, ge=1, description="max_tokens at most (set on a request without "
                                   "one)")
    variant: str | None = Field(default=None, min_length=1, description="a smaller model that answers instead "
                                "(skipped unless it can answer now, not scaled to zero, and is less loaded)")
    cache_similarity: float | None = Field(default=None, ge=0.5, le=1, description="a semantic cache hit at this "
                                           "cosine or more serves (where the cache is semantic and its own threshold "
                                           "is higher; the guards and the verifier still apply)")

    @model_validator(mode="after")
    def _does_something(self) -> Degradation:
        if self.max_tokens is None and self.variant is None and self.cache_similarity is None:
            raise ValueError("a degradation policy sets max_tokens, variant, cache_similarity or some of them")
        return self


class MeshConfig(_Strict):
    default: ModelPolicy = ModelPolicy()
    models: dict[str, ModelPolicy] = {}
    splits: dict[str, TrafficSplit] = {}
    rate_limits: dict[str, RateLimit] = Field(default={}, description="per tenant; '*' for any other tenant")
    tenants: dict[str, TenantPolicy] = Field(default={}, description="per tenant; '*' for any other tenant")
    groups: dict[str, Grant] = Field(default={}, description="per JWT group: widens the tenant's grant")
    prices: dict[str, Price] = Field(default={}, description="per model, for budgets and usage")
    cache: CacheConfig = CacheConfig()
    circuit_breaker: CircuitBreaker = CircuitBreaker()
    retry_budget: RetryBudget = RetryBudget()
    providers: dict[str, Provider] = Field(default={}, description="external OpenAI-compatible upstreams; "
                                           "a model they map is answered by them (directly or as a fallback)")
    autoscaling: Autoscaling = Autoscaling()
    shadows: dict[str, Shadow] = Field(default={}, description="per name clients call (alias or model)")
    cascades: dict[str, Cascade] = Field(default={}, description="aliases answered cheap-first")
    flow_control: FlowControl = FlowControl()
    degradation: dict[str, dict[ClassName, Degradation]] = Field(default={}, description="per model (as routed, "
                                                                 "not an alias), per class")

    @model_validator(mode="after")
    def _aliases_are_not_models(self) -> MeshConfig:
        both = set(self.splits) & set(self.models)
        if both:
            raise ValueError(f"names used both as a split alias and a model: {sorted(both)}")
        for alias, split in self.splits.items():
            if any(t.model == alias for t in split.targets):
                raise ValueError(f"split '{alias}' targets itself")
        taken = (set(self.splits) | set(self.models)) & set(self.cascades)
        if taken:
            raise ValueError(f"names used both as a cascade alias and a split or model: {sorted(taken)}")
        for alias, cascade in self.cascades.items():
            if {cascade.cheap, cascade.strong} & (set(self.cascades) | set(self.splits)):
                raise ValueError(f"cascade '{alias}' must name two models, not itself, a split or another cascade")
        for alias, shadow in self.shadows.items():
            if shadow.model == alias:
                raise ValueError(f"shadow of '{alias}' copies to itself")
        for model, rules in self.degradation.items():
            for rule in rules.values():
                if rule.variant is not None and (rule.variant == model or rule.variant in self.splits
                                                 or rule.variant in self.cascades):
                    raise ValueError(f"degradation of '{model}': its variant must be another model, not an alias")
        return self

    def tenant(self, name: str) -> TenantPolicy:
        return self.tenants.get(name) or self.tenants.get("*") or _OPEN_TENANT

    def rate_limit(self, tenant: str) -> RateLimit | None:
        return self.rate_limits.get(tenant) or self.rate_limits.get("*")

    def provider_for(self, model: str) -> tuple[str, Provider] | None:
        for name, p in self.providers.items():
            if model in p.models:
                return name, p
        return None

    def policy(self, model: str) -> ModelPolicy:
        return self.models.get(model, self.default)


_OPEN_TENANT = TenantPolicy()

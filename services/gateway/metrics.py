"""Gateway metrics: what operators run an LLM platform by, per model and tenant.

Every label value comes from the configuration or the fleet, never straight from a
client: a model name becomes a label only when the gateway knows it (``known``: the
catalog, splits, cascades, providers), any other is ``unknown``; tenants come from keys
and verified tokens, statuses and results from fixed sets. So the number of series does
not grow with what clients send."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llmesh.buckets import LATENCY_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from llmesh.gateway.record import RequestRecord


UNKNOWN_MODEL = "unknown"  # the model label of a request for a name the gateway does not know


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, known: Callable[[str], bool]):
        self._known = known  # model names that may become labels
        self.requests = Counter("llmesh_requests", "Requests by model, tenant and outcome.",
                                ("model", "tenant", "status"), registry=registry)
        self.ttft = Histogram("llmesh_time_to_first_token_seconds", "Time to first token seen by clients.",
                              ("model",), buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram("llmesh_time_per_output_token_seconds", "Time per output token after the first.",
                              ("model",), buckets=TPOT_BUCKETS, registry=registry)
        self.e2e = Histogram("llmesh_e2e_request_latency_seconds", "Whole-request latency.",
                             ("model",), buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("llmesh_prompt_tokens", "Input tokens.", ("model", "tenant"), registry=registry)
        self.generation_tokens = Counter("llmesh_generation_tokens", "Output tokens.", ("model", "tenant"),
                                         registry=registry)
        self.cache = Counter("llmesh_cache_requests", "Response-cache lookups by result.", ("result",),
                             registry=registry)
        self.cache_saved_tokens = Counter("llmesh_cache_saved_tokens", "Tokens cache hits did not spend (the "
                                          "cached answer's prompt and completion), by model and hit kind "
                                          "(exact, semantic).", ("model", "kind"), registry=registry)
        self.cache_saved_usd = Counter("llmesh_cache_saved_usd", "What the tokens cache hits did not spend would "
                                       "have cost, at the model's price in live config.", ("model", "kind"),
                                       registry=registry)
        self.rate_limited = Counter("llmesh_rate_limited_requests", "Requests refused by a rate limit or budget.",
                                    ("tenant",), registry=registry)
        self.retries = Counter("llmesh_retries", "Attempts on another engine before the first token.",
                               ("model",), registry=registry)
        self.fallbacks = Counter("llmesh_fallbacks", "Requests served by a fallback model (the model label).",
                                 ("model",), registry=registry)
        self.failovers = Counter("llmesh_stream_failovers", "Answers continued on another engine after the "
                                 "one streaming them failed.", ("model",), registry=registry)
        self.retry_budget_exhausted = Counter("llmesh_retry_budget_exhausted",
                                              "Requests that failed because the retry budget was spent.",
                                              registry=registry)
        # Each worker process has its own breakers: with several, one series per live worker (a pid label).
        self.breaker = Gauge("llmesh_circuit_breaker_state", "0 closed, 1 open, 2 half-open.", ("endpoint",),
                             registry=registry, multiprocess_mode="liveall")
        self.limits_fallback = Counter("llmesh_limits_fallback", "Admissions decided by this replica's local "
                                       "limiter because Redis did not answer.", registry=registry)
        self.flow_fallback = Counter("llmesh_flow_shared_fallback", "Times flow control's queues shared through "
                                     "Redis did not answer and requests queued in this worker instead.",
                                     registry=registry)
        self.picks = Counter("llmesh_endpoint_picks", "Endpoint choices by routing policy.",
                             ("policy", "endpoint"), registry=registry)
        self.engines_lost = Counter("llmesh_engines_lost", "Engines whose process went away under a request "
                                    "(killed, crashed).", ("model",), registry=registry)
        self.poison_requests = Counter("llmesh_poison_requests", "Requests refused because the engines they "
                                       "were sent to went away under them, one after another.", ("model",),
                                       registry=registry)
        self.audit_failures = Counter("llmesh_audit_write_failures", "Audit records that could not be written "
                                      "(refused by the log, or lost with a batch whose write failed).",
                                      registry=registry)
        self.auth_cache = Gauge("llmesh_auth_cache_entries", "API key records the authenticator holds, by kind "
                                "(known keys, and key ids the store did not know); bounded LRUs.", ("kind",),
                                registry=registry, multiprocess_mode="liveall")

        # Labelled series by label values, looked up once: prometheus_client's labels() takes a lock and
        # checks the values on every call. A series still appears only when a request first uses it.
        self._series: dict[tuple, object] = {}

    def _of(self, metric, *values: str):
        key = (metric, *values)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = metric.labels(*values)
        return series

    def observe(self, r: RequestRecord) -> None:
        """Called once per request with the pipeline's record of it."""
        model = r.model if self._known(r.model) else UNKNOWN_MODEL
        tenant, of = r.tenant, self._of
        of(self.requests, model, tenant, r.status).inc()
        of(self.e2e, model).observe(r.duration_ms / 1000)
        if r.cache in ("hit", "miss"):
            of(self.cache, r.cache).inc()
        if r.cache_kind is not None and r.status == "ok":
            of(self.cache_saved_tokens, model, r.cache_kind).inc(r.saved_prompt_tokens + r.saved_completion_tokens)
            of(self.cache_saved_usd, model, r.cache_kind).inc(r.saved_usd or 0.0)
        if r.endpoint:
            of(self.picks, r.policy or "", r.endpoint).inc()
        if r.reason in ("rate_limit_exceeded", "insufficient_quota"):
            of(self.rate_limited, tenant).inc()
        if r.retries:
            of(self.retries, model).inc(r.retries)
        if r.failovers:
            of(self.failovers, model).inc(r.failovers)
        if r.engines_lost:
            of(self.engines_lost, model).inc(r.engines_lost)
            if r.reason == "poison_request":
                of(self.poison_requests, model).inc()
        if r.retry_budget_exhausted:
            self.retry_budget_exhausted.inc()
        if r.fallback and r.status == "ok":
            of(self.fallbacks, r.fallback).inc()
        if r.status != "ok":
            return
        of(self.prompt_tokens, model, tenant).inc(r.prompt_tokens)
        of(self.generation_tokens, model, tenant).inc(r.completion_tokens)
        if r.ttft_ms is not None:
            of(self.ttft, model).observe(r.ttft_ms / 1000)
            if r.completion_tokens > 1:
                of(self.tpot, model).observe((r.duration_ms - r.ttft_ms) / 1000 / (r.completion_tokens - 1))


class LedgerMetrics:
    """Load-ledger sharing between gateway processes (upstream/ledger_share.py): the peers each
    counts, and the rounds that failed."""

    def __init__(self, registry: CollectorRegistry):
        self.peers = Gauge("llmesh_ledger_peers", "Other gateway processes (workers, replicas) whose requests "
                           "in flight this one counts when it routes, from the last round through Redis; 0 "
                           "while sharing is down.", registry=registry, multiprocess_mode="liveall")
        self.failures = Counter("llmesh_ledger_share_failures", "Rounds of load-ledger sharing that failed (Redis "
                                "did not answer within a second, or answered an error); the process routes on "
                                "its own counts until one succeeds.", registry=registry)

    def round(self, peers: int | None) -> None:
        """A round of sharing: the live peers it counted, or None when it failed."""
        self.peers.set(peers or 0)
        if peers is None:
            self.failures.inc()


class FlowMetrics:
    """Flow control's queues (stages/flow.py): depth and wait per model, tenant and class, and the
    requests it turned away by reason, and the weight of each tenant that waited (its served-token
    share under contention follows it). Served tokens per tenant are ``llmesh_prompt_tokens`` and
    ``llmesh_generation_tokens``."""

    def __init__(self, registry: CollectorRegistry):
        self.depth = Gauge("llmesh_flow_queued", "Requests waiting in the gateway for capacity.",
                           ("model", "tenant", "class"), registry=registry, multiprocess_mode="livesum")
        self.wait = Histogram("llmesh_flow_wait_seconds", "How long a request waited in the gateway for capacity "
                              "before it was sent on.", ("model", "tenant", "class"), buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.refusals = Counter("llmesh_flow_refusals", "Requests flow control turned away, by reason (queue_full, "
                                "tenant_queue_full, preempted, shed, deadline, expired).",
                                ("model", "tenant", "class", "reason"), registry=registry)
        self.weight = Gauge("llmesh_flow_tenant_weight", "The live config's weight of each tenant whose requests "
                            "waited for capacity (set when one starts waiting).", ("tenant",), registry=registry,
                            multiprocess_mode="livemax")

    def queued(self, model: str, tenant: str, klass: str, delta: int) -> None:
        self.depth.labels(model, tenant, klass).inc(delta)

    def waited(self, model: str, tenant: str, klass: str, seconds: float) -> None:
        self.wait.labels(model, tenant, klass).observe(seconds)

    def refused(self, model: str, tenant: str, klass: str, reason: str) -> None:
        self.refusals.labels(model, tenant, klass, reason).inc()

    def weighted(self, tenant: str, weight: float) -> None:
        self.weight.labels(tenant).set(weight)


class DegradeMetrics:
    """Degradation under load (stages/degrade.py): each policy applied, by the model asked for
    (as routed), the request's class and the policy (max_tokens, variant, cache)."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("llmesh_degraded_requests", "Requests degraded under load, by model, class and "
                                "policy applied (a request with two policies counts once for each).",
                                ("model", "class", "policy"), registry=registry)

    def degraded(self, model: str, klass: str, policy: str) -> None:
        self.requests.labels(model, klass, policy).inc()

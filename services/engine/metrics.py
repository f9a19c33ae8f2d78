"""Engine metrics under vLLM 0.32's names, types, labels (``model_name``, ``engine``) and
meanings, so a dashboard, alert or KEDA rule written for vLLM's own server reads llmesh engines
too (tests/unit/test_engine_metrics_vllm.py checks them against vLLM 0.32's stat loggers)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llmesh.buckets import LATENCY_BUCKETS, TOKEN_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from llmesh.types import Priority


class EngineMetrics:
    """The engine's series, bound to the model it serves (``use_model`` rebinds after a
    model swap; the old model's series stay, frozen, as vLLM's do across restarts)."""

    # Each family's child for the current model, bound by use_model.
    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    prefix_queries: Counter
    prefix_hits: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    ttft: Histogram
    tpot: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram

    # vLLM's `engine` label: the engine core's index in a data-parallel deployment; one core here.
    ENGINE = "0"

    def __init__(self, registry: CollectorRegistry, model: str, kv_usage: Callable[[], float] | None = None):
        """``kv_usage``: read the backend's KV-cache use when scraped (it changes every decode step,
        as vLLM's stat loggers report it, not only when requests come and go); None: ``load`` sets it."""
        self._read_kv = kv_usage
        m = ("model_name", "engine")
        r = registry
        self._families = {
            "running": Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", m,
                             registry=r),
            "waiting": Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m,
                             registry=r),
            "kv_usage": Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m,
                              registry=r),
            "prefix_queries": Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.", m, registry=r),
            "prefix_hits": Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens.", m, registry=r),
            "prompt_tokens": Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r),
            "generation_tokens": Counter("vllm:generation_tokens", "Number of generation tokens processed.", m,
                                         registry=r),
            "ttft": Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              m, buckets=TTFT_BUCKETS, registry=r),
            # per request: decode time / (generated tokens - 1), as vLLM's
            "tpot": Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              m, buckets=TPOT_BUCKETS, registry=r),
            "itl": Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             m, buckets=TPOT_BUCKETS, registry=r),
            "e2e": Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             m, buckets=LATENCY_BUCKETS, registry=r),
            "queue_time": Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    m, buckets=LATENCY_BUCKETS, registry=r),
            "request_prompt_tokens": Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               m, buckets=TOKEN_BUCKETS, registry=r),
            "request_generation_tokens": Histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   m, buckets=TOKEN_BUCKETS, registry=r),
        }
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                m + ("finished_reason",), registry=r)
        # Ours, not vLLM's: requests the wait queue turned away, by priority class and
        # why ("queue_full" on arrival, "shed" for a newcomer of a higher class).
        self._refused = Counter("llmesh_engine_refused_requests", "Requests refused by the engine's wait queue, "
                                "by priority class and reason (queue_full, shed).",
                                ("model_name", "priority", "reason"), registry=r)
        self._prefix_seen = (0, 0)
        self.use_model(model)

    def use_model(self, model: str) -> None:
        read = self._read_kv
        if read is not None and hasattr(self, "kv_usage"):
            self.kv_usage.set_function(lambda: 0.0)  # the old model's series stays, at 0: it holds no KV now
        self.model = model
        for name, family in self._families.items():
            setattr(self, name, family.labels(model, self.ENGINE))
        if read is not None:
            self.kv_usage.set_function(read)
        self._success_by_reason: dict[str, Counter] = {}  # this model's children, looked up once

    def success(self, finished_reason: str) -> None:
        child = self._success_by_reason.get(finished_reason)
        if child is None:
            child = self._success_by_reason[finished_reason] = self._success.labels(self.model, self.ENGINE,
                                                                                    finished_reason)
        child.inc()

    def refused(self, priority: Priority, reason: str) -> None:
        self._refused.labels(self.model, priority.name.lower(), reason).inc()

    def load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        if self._read_kv is None:
            self.kv_usage.set(kv_usage)

    def prefix_cache(self, queries: int, hits: int) -> None:
        """Cumulative token counts from the backend; counts the growth since last time."""
        q0, h0 = self._prefix_seen
        if queries >= q0 and hits >= h0:
            self.prefix_queries.inc(queries - q0)
            self.prefix_hits.inc(hits - h0)
        self._prefix_seen = (queries, hits)

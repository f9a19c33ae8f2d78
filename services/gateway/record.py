"""One request's record: what the access log, the metrics, the audit log and usage
accounting read about a request once it is over. The pipeline fills in the core;
stages add what they decided (caller, limits, guards, cost)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

MAX_MODEL = 256  # the longest model name a request may carry (the protos' rule); a record keeps no more


def clipped(model: str) -> str:
    """The model name as a record keeps it before validation: a name over the rule's
    limit (which validation then refuses) is cut, so logs and spans stay small."""
    return model if len(model) <= MAX_MODEL else model[:MAX_MODEL] + "..."


@dataclass(slots=True)
class RequestRecord:
    model: str  # the model that answered: the routed target, or the fallback
    tenant: str
    endpoint: str | None = None  # the last upstream tried: an endpoint id or "provider:NAME"
    cache: Literal["skip", "hit", "miss"] = "skip"
    status: str = "ok"  # ok | cancelled | an ErrorCode value
    ttft_ms: float | None = None  # None: no token reached the client
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retries: int = 0  # attempts after the first, before the first token
    duration_ms: float = 0.0
    # Set only when they happened (and logged only then).
    policy: str | None = None  # the routing policy the endpoint was picked by
    reason: str | None = None  # the error's stable reason word
    finish_reason: str | None = None
    fallback: str | None = None  # the fallback model that answered
    failovers: int = 0  # times the answer moved to another engine mid-stream
    engines_lost: int = 0  # engines whose process went away under the request (killed, crashed)
    breaker_panic: bool = False  # every endpoint's breaker was open; one was tried anyway
    retry_budget_exhausted: bool = False
    caller: str | None = None  # key id, JWT subject or "local"
    limits: str | None = None  # where the rate limit was decided: redis | local | none
    cost_usd: float | None = None
    pii: dict[str, int] | None = None  # masked entities by kind
    injection_score: float | None = None
    injection_rules: list[str] | None = None
    injection_truncated: bool = False  # the prompt was longer than the screen reads (its caps)
    cascade: str | None = None  # a cascade's decision: accepted | escalated
    cascade_confidence: float | None = None  # the cheap answer's mean token logprob
    held_ms: float | None = None  # held while a scaled model had no ready replica (scale from zero)
    client_request_id: str | None = None  # the client's x-request-id when it was replaced (escaped, cut short)
    # A cache hit: which kind, and what its answer cost when it was made (its tokens are not spent again;
    # prompt_tokens and completion_tokens above stay 0, what the request really spent).
    cache_kind: str | None = None  # exact | semantic
    saved_prompt_tokens: int = 0
    saved_completion_tokens: int = 0
    saved_usd: float | None = None  # their price, at the model's price in live config

    def log_fields(self) -> dict[str, Any]:
        """The access log's fields: the core always, the rest when they happened."""
        out = {name: getattr(self, name) for name in _ALWAYS}
        for name in _WHEN_SET:
            value = getattr(self, name)
            if value is None or value is False or (type(value) is int and value == 0):  # did not happen
                continue
            out[name] = value
        return out


_ALWAYS = ("model", "tenant", "endpoint", "cache", "status", "ttft_ms", "prompt_tokens", "completion_tokens",
           "retries", "duration_ms")
_WHEN_SET = tuple(name for name in RequestRecord.__dataclass_fields__ if name not in _ALWAYS)

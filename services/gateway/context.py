"""The request as the gateway's stages see it: who sent it (``Caller``), what it asks
(``CompletionRequest``) and the per-request ``Context`` a stage reads, rewrites and
annotates. Stages, the pipeline and the upstream router import these types from here,
never from one another.

A stage that needs state of its own for one request keeps it in a typed ``Slot``; a
stage that wraps the way to the answer (the cache, a cascade, a shadow copy) puts a
``Wrap`` around the upstream with ``Context.wrap``, the one hook for that."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from opentelemetry.trace import INVALID_SPAN, Span

from llmesh.liveconfig.schema import ModelPolicy
from llmesh.types import Delta, Finish, Priority, Prompt, Sampling, Tools
from llmesh.gateway.domain.prompt_tokens import RequestTokens
from llmesh.gateway.record import RequestRecord

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, as authentication found it."""
    tenant: str = "default"
    subject: str = "local"        # key id, JWT subject, or "local" in local mode
    method: str = "local"         # api_key | jwt | local
    groups: tuple[str, ...] = ()
    models: tuple[str, ...] | None = None  # a key's own model list, narrower than the tenant's


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    request_id: str
    tenant: str
    model: str
    prompt: Prompt
    sampling: Sampling
    timeout_s: float
    user: str | None = None  # keeps a user on one arm of a traffic split
    trace_headers: Mapping[str, str] | None = None  # W3C trace context from HTTP clients
    operation: str = "chat"  # gen_ai.operation.name: chat | text_completion
    credential: str | None = None  # the bearer token or API key the client sent
    caller: Caller = Caller()
    priority: Priority = Priority.NORMAL
    continuation: str = ""  # answer text already sent, when a stream fails over to another engine
    tools: Tools | None = None  # functions the model may call (providers; engines whose backend calls tools)
    checked: bool = False  # the front already checked it against the protos' rules (gRPC: as it arrived)
    stream: bool = True  # False: the client takes the answer at once (upstreams may send it whole)
    client_request_id: str | None = None  # the client's x-request-id when it was replaced (llmesh.request_id)
    # Set: an embeddings request (operation "embeddings") of these texts, in order; the prompt is empty
    # and the stages that concern generated text pass it by (``embeds``).
    inputs: tuple[str, ...] | None = None
    dimensions: int | None = None  # embeddings: the vector size asked for (a model that cannot refuses)
    # Set: a batch line (never from a front's client): it runs as this caller, the batch's maker,
    # whose key the auth stage checks again, at Priority.LOW whatever the tenant's grant says.
    on_behalf: Caller | None = None

    @property
    def embeds(self) -> bool:
        return self.inputs is not None

    @classmethod
    def unread(cls, request_id: str, operation: str, client_request_id: str | None = None) -> CompletionRequest:
        """A request whose body its front could not take (``Pipeline.refused``): its id and
        operation only, no model, prompt nor caller."""
        return cls(request_id=request_id, tenant="", model="", prompt=Prompt(), sampling=Sampling(), timeout_s=0.0,
                   operation=operation, client_request_id=client_request_id)


@dataclass(frozen=True, slots=True)
class Vectors(Finish):
    """An embeddings request's answer, its only item: each input's vector as little-endian
    float32 bytes, in the inputs' order; ``usage.prompt_tokens`` counts the inputs' tokens."""
    vectors: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class WholeAnswer(Delta):
    """An answer that comes in one piece (a cache hit): output filters flush with it, so
    it reaches the client as one delta."""


@dataclass(frozen=True, slots=True)
class CacheHit:
    """The response cache's answer to a request: the stored text and finish (its usage is what
    producing it cost) and how it matched (exact | semantic)."""
    text: str
    finish: Finish
    kind: str = "exact"
    loosened: bool = False  # a semantic hit only a looser threshold (degradation) allowed


@dataclass(frozen=True, slots=True)
class LooseCache:
    """Degradation's cache policy for one request: a semantic hit at ``min_similarity`` or more
    may serve it; ``served()`` when one below the cache's own threshold did."""
    min_similarity: float
    served: Callable[[], None]


class OutputFilter(Protocol):
    """Rewrites the answer's text as it streams (PII masking, restoring)."""
    def feed(self, text: str) -> str: ...
    def flush(self) -> str: ...


Items = AsyncGenerator[Delta | Finish, None]
"""An answer as it streams: text deltas, then one Finish. Whoever takes it closes it
(``contextlib.aclosing``), so it is an async generator, not any async iterator."""

Call = Callable[[CompletionRequest], Items]


class Upstream(Protocol):
    """The way to the answer, as a ``Wrap`` sees it."""

    def __call__(self, req: CompletionRequest) -> Items:
        """This request's answer from ``req.model``: its endpoints (or provider), retries and
        fallbacks per that model's policy, within the request's deadline and retry budget.
        The request's record and headers say what happened (endpoint, fallback, failover)."""
        ...

    def detached(self, req: CompletionRequest) -> Items:
        """The answer to a copy of the request (shadow), apart from it: per ``req.model``'s
        policy, within ``req.timeout_s``, outside the retry budget; nothing of it lands in
        this request's record or headers."""
        ...


Wrap = Callable[[CompletionRequest, Upstream], Items]
"""Given the request and the upstream as the stages before left it, yields the answer
(before output filters): it may answer itself (a cache hit), call the upstream once or
more (a cascade), or watch what passes (a shadow's primary answer)."""


class Slot(Generic[T]):
    """One stage's own state for one request, typed: ``slot.put(ctx, value)`` in ``admit``,
    ``slot.get(ctx)`` in ``finish`` (None when ``admit`` put nothing). A stage makes its
    slot once, in its constructor."""
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def get(self, ctx: Context) -> T | None:
        state = ctx.state
        return None if state is None else state.get(self)

    def put(self, ctx: Context, value: T) -> None:
        if ctx.state is None:
            ctx.state = {self: value}
        else:
            ctx.state[self] = value

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


@dataclass(slots=True)
class Context:
    """One request as the stages see it. ``record`` is the access-log record;
    ``headers`` reach the client (HTTP headers, gRPC trailing metadata)."""
    req: CompletionRequest
    record: RequestRecord
    span: Span
    policy: ModelPolicy = ModelPolicy()
    headers: dict[str, str] = field(default_factory=dict)
    filters: list[OutputFilter] = field(default_factory=list)
    asked: str = ""  # the model name the client asked for (an alias, before any stage rewrote it)
    state: dict[Slot[Any], Any] | None = None  # the stages' slots (made on the first put)
    wraps: list[Wrap] | None = None  # see ``wrap``
    # What the choices of one request (n > 1) share: a stage's work on the prompt they have in
    # common (the guards screen it once, not once per choice). None: a request of one choice.
    shared: dict[Any, Any] | None = None
    loose_cache: LooseCache | None = None  # set by the degradation stage under load
    tokens: RequestTokens | None = None  # the prompt's tokens as the limits counted them (the router's, if unchanged)

    def wrap(self, wrap: Wrap) -> None:
        """Puts ``wrap`` around the upstream, as the stages before left it: a wrap put later
        sees what the earlier ones made of the answer (the cache sees a cascade's, a shadow
        the cache's)."""
        if self.wraps is None:
            self.wraps = [wrap]
        else:
            self.wraps.append(wrap)

    @classmethod
    def of(cls, req: CompletionRequest, shared: dict[Any, Any] | None = None) -> Context:
        """A blank context to hand to ``Pipeline.run``, which fills it in; the choices of one
        request pass one ``shared`` dict."""
        return cls(req, RequestRecord(req.model, req.tenant), INVALID_SPAN, shared=shared)


class Catalog(Protocol):
    """The models the gateway knows (registered or served)."""
    def known(self, model: str) -> bool: ...

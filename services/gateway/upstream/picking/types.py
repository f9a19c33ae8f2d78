"""The plain inputs every filter and scorer sees."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from llmesh.kvhash import HashScheme
from llmesh.types import Prompt
from llmesh.gateway.domain.tokens import utf8_size


@dataclass(frozen=True, slots=True)
class Endpoint:
    endpoint_id: str
    address: str
    models: frozenset[str]
    running: int = 0
    waiting: int = 0
    max_running: int = 1
    max_waiting: int = 0  # its own queue's bound (0: unknown or none)
    healthy: bool = True
    degraded: str = ""  # why the scheduler took the node out of routing; empty: it is fine
    kv_hash: HashScheme | None = None  # how the engine names its KV blocks; None: unknown
    # What the engine reported serving: each model or adapter's context length (absent: unknown),
    # and each LoRA adapter loaded there with the requests naming it in flight.
    context: Mapping[str, int] = field(default_factory=dict)
    adapters: Mapping[str, int] = field(default_factory=dict)
    embeds: frozenset[str] = frozenset()  # its models that are embedding models (Embed, not Generate)
    tools: frozenset[str] = frozenset()  # its models whose backend calls tools (Capabilities.tools)


@dataclass(slots=True)
class PickInput:
    """One request as the picker sees it. Its tokens, and their block hashes under each
    engine's scheme, are computed on first use: a policy without a prefix scorer never
    tokenizes the prompt."""
    model: str
    now: float
    exclude: frozenset[str] = frozenset()
    session: str | None = None
    work_tokens: int = 0                       # estimated prefill + decode tokens of this request
    tokens: Callable[[], Sequence[int]] = lambda: ()
    max_tokens: int | None = None              # the completion tokens the request asks for; None: not set
    filters: tuple[str, ...] = ()              # the policy's optional filters (OPTIONAL_FILTERS), in order
    embed: bool = False                        # an embeddings request: only embedding models' endpoints
    tools: bool = False                        # the request needs tool calling: only endpoints that call tools
    uncached: int | None = None                # set by a pick: the prompt tokens the chosen engine lacks
    _tokens: Sequence[int] | None = field(default=None, repr=False)
    _hashes: dict[HashScheme, list[int]] = field(default_factory=dict, repr=False)
    # endpoint -> leading blocks its engine holds, as counted during the current pick (cleared by each pick)
    matched: dict[str, int] = field(default_factory=dict, repr=False)

    def prompt_tokens(self) -> Sequence[int]:
        if self._tokens is None:
            self._tokens = self.tokens()
        return self._tokens

    def context_tokens(self) -> int:
        """Context the request needs on an engine: its prompt tokens (exact where the
        gateway has the model's tokenizer, else the work estimate's share) plus the
        completion it asks for (at least one token), as engines check it."""
        n = len(self.prompt_tokens())
        if not n:
            n = max(self.work_tokens - (self.max_tokens or DEFAULT_OUTPUT_TOKENS), 0)
        return n + (self.max_tokens or 1)

    def hashed(self) -> set[HashScheme]:
        """The schemes a scorer has hashed the prompt with so far."""
        return set(self._hashes)

    def block_hashes(self, scheme: HashScheme) -> list[int]:
        if scheme not in self._hashes:
            self._hashes[scheme] = scheme.block_hashes(self.prompt_tokens())
        return self._hashes[scheme]


# The counts a gateway publishes to its peers (picking.peers), in this order; ``since_report``
# goes apart, with the report it counts from (``peer_since``).
PeerCount = Literal["prefill_tokens", "prefill_requests", "decode_seqs", "decode_tokens", "inflight"]
PEER_COUNTS: tuple[PeerCount, ...] = get_args(PeerCount)
_INDEX = {name: n for n, name in enumerate(PEER_COUNTS)}


@dataclass(slots=True)
class LocalState:
    """What this gateway knows that the scheduler's reports lag on: its own work in
    flight per endpoint (requests and estimated tokens), the requests it started
    (+1) and finished (-1) since the engine's last report changed, and endpoints it
    saw refuse."""
    inflight: dict[str, int] = field(default_factory=dict)
    inflight_tokens: dict[str, int] = field(default_factory=dict)
    low_inflight: int = 0  # of those, the lowest-priority ones (batch lines), over every endpoint
    since_report: dict[str, int] = field(default_factory=dict)
    down_until: dict[str, float] = field(default_factory=dict)
    # The load ledger: per endpoint, the uncached prompt tokens (and their requests) this gateway
    # sent and has not yet seen start (released at the first streamed chunk), and the sequences
    # that started and have not ended with the tokens of context they hold (released at the end).
    prefill_tokens: dict[str, int] = field(default_factory=dict)
    prefill_requests: dict[str, int] = field(default_factory=dict)
    decode_seqs: dict[str, int] = field(default_factory=dict)
    decode_tokens: dict[str, int] = field(default_factory=dict)
    # The other gateways' ledgers (workers and replicas sharing a Redis, picking.peers): per
    # endpoint, their counts summed, in PEER_COUNTS order; empty with no peers.
    peers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Theirs since a report: per endpoint, each live peer's (since_report, running, waiting) of
    # the report it last saw; and ours: the running and waiting of the last report of each endpoint.
    peer_since: dict[str, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    reported: dict[str, tuple[int, int]] = field(default_factory=dict)
    # How each endpoint is named to peers: its id and address (two engines of one name at two
    # addresses, as two meshes on one Redis have, are not one); an endpoint not in the table: its id.
    shared_names: dict[str, str] = field(default_factory=dict)

    def shared_name(self, endpoint_id: str) -> str:
        return self.shared_names.get(endpoint_id, endpoint_id)

    def all_of(self, counts: PeerCount, endpoint_id: str) -> int:
        """One of the ledger's counts over every gateway: ours and the peers' last published."""
        own: int = getattr(self, counts).get(endpoint_id, 0)
        theirs = self.peers.get(self.shared_name(endpoint_id))
        return own + theirs[_INDEX[counts]] if theirs else own

    def add(self, counts: str, endpoint_id: str, n: int) -> None:
        """Adds ``n`` (negative: takes) to one of the ledger's counts; nothing below zero is kept."""
        table: dict[str, int] = getattr(self, counts)
        left = table.get(endpoint_id, 0) + n
        if left > 0:
            table[endpoint_id] = left
        else:
            table.pop(endpoint_id, None)

    def queued_prefill(self, e: Endpoint, each: int) -> int:
        """Uncached prompt tokens waiting to start there: every gateway's, from the ledgers, and
        the requests the last report shows waiting beyond those at ``each`` tokens (a report that
        lags counts ours as waiting still: never less than the ledgers, never the report alone)."""
        ours = self.all_of("prefill_requests", e.endpoint_id)
        return self.all_of("prefill_tokens", e.endpoint_id) + max(e.waiting - ours, 0) * each

    def decoding(self, e: Endpoint) -> int:
        """Sequences decoding there: the last report's running ones or the ledgers', the more."""
        return max(e.running, self.all_of("decode_seqs", e.endpoint_id))

    def requests(self, e: Endpoint) -> int:
        """Running + waiting there now: the last report (all gateways' work) corrected by what
        every gateway started and finished since (a peer's only while the report it counts from
        is the one we hold), and never less than every gateway's work in flight."""
        eid = e.endpoint_id
        theirs = self.peer_since.get(self.shared_name(eid), ())
        since = self.since_report.get(eid, 0) + sum(n for n, running, waiting in theirs
                                                    if (running, waiting) == (e.running, e.waiting))
        return max(e.running + e.waiting + since, self.all_of("inflight", eid), 0)

    def load(self, e: Endpoint) -> float:
        """Requests per slot."""
        return self.requests(e) / max(e.max_running, 1)


DEFAULT_OUTPUT_TOKENS = 256  # a request that sets no max_tokens is expected to ask for this many


def work_tokens(prompt: Prompt, max_tokens: int | None, default_output: int = DEFAULT_OUTPUT_TOKENS,
                inputs: tuple[str, ...] | None = None) -> int:
    """A request's work before it is tokenized: ~1 token per 3 bytes of prompt, plus
    the answer it may ask for; an embeddings request's ``inputs``: theirs, and no answer."""
    if inputs is not None:
        return sum(utf8_size(t) for t in inputs) // 3
    texts = [m.content for m in prompt.messages] if prompt.messages is not None else [prompt.text or ""]
    return sum(utf8_size(t) for t in texts) // 3 + (max_tokens or default_output)


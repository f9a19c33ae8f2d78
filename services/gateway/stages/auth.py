"""Who is calling: API keys and JWT bearer tokens -> a Caller (tenant, groups).

Local mode (every request is the tenant ``default``, what ``make run`` on 127.0.0.1
gives) is decided at start from settings (llmesh.gateway.domain.auth_mode), never from
the key store: with it off, a request without valid credentials gets 401 even while the
store is empty (flushed, evicted, a fresh replica), and the log says why once a minute.
In local mode the first API key in the store ends it, and a real key is its tenant;
a credential the store does not know is any credential (never refused while garbage
passes).

Key records are read from the shared store and kept for ``cache_s`` (0.5 s), so
a revocation reaches every gateway replica within a second at the cost of two
store reads per key and second. Key ids come from clients, so what is kept is
bounded: the records of known keys in an LRU of ``max_keys`` (4,096), the key ids
the store did not know in one of ``max_unknown`` (1,024), apart, so a flood of
made-up ids never pushes a real key out (and with it the record a store outage
would fall back on); a key id over ``MAX_KEY_ID`` characters is refused unread."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from llmesh.errors import Unauthenticated, Unavailable
from llmesh.keys import ApiKey, KeyStore, matches, split_key
from llmesh.gateway.context import Caller, Context
from llmesh.gateway.stages.base import Stage
from llmesh.gateway.stages.jwt_auth import JwtSettings, JwtVerifier

__all__ = ["Authenticator", "AuthenticateStage", "JwtSettings", "JwtVerifier", "LOCAL"]

log = logging.getLogger("llmesh.gateway.auth")

LOCAL = Caller()
MAX_KEYS = 4096  # known keys' records kept
MAX_UNKNOWN = 1024  # key ids the store did not know, kept as briefly (cache_s)
MAX_KEY_ID = 64  # ours are 12 hex digits; a longer id is refused without a store read
EMPTY_STORE_LOG_S = 60.0  # how often a refusal while the key store is empty is explained in the log


class Authenticator:
    """``local``: local mode, as decided at start (llmesh.gateway.domain.auth_mode); off
    (the default), credentials are always required. ``store_errors``: what the key store
    raises when it cannot answer; then the last record seen is used (and a key never seen
    gets 503), so a Redis outage keeps known callers served."""

    def __init__(self, keys: KeyStore | None, jwt_verifier: JwtVerifier | None = None,
                 cache_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, local: bool = False,
                 store_errors: tuple[type[BaseException], ...] = (OSError,), max_keys: int = MAX_KEYS,
                 max_unknown: int = MAX_UNKNOWN, on_size: Callable[[str, int], None] = lambda kind, n: None):
        self._keys = keys
        self._jwt = jwt_verifier
        self._cache_s = cache_s
        self._clock = clock
        self._wall = wall
        self._local = local and jwt_verifier is None  # a JWKS always requires credentials
        self._explained_at = float("-inf")  # the last time the log said why an empty store refuses
        self._errors = store_errors
        self._known = _Lru(max_keys)  # key id -> (read at, record)
        self._unknown = _Lru(max_unknown)  # key id -> (read at, None): the store has no such key
        self._on_size = on_size  # ("known" | "unknown", entries) after each change
        self._inflight: dict[str, asyncio.Future[ApiKey | None]] = {}  # one store read per key at a time
        self._required: tuple[float, bool] = (float("-inf"), False)

    async def required(self) -> bool:
        """Whether this request needs valid credentials. Off local mode always; in local
        mode once the store holds a key (the store may end local mode, never begin it)."""
        if not self._local:
            return True
        if self._keys is None:
            return False
        at, value = self._required
        if self._clock() - at > self._cache_s:
            try:
                value = await self._keys.configured()
            except self._errors:
                value = value if at > float("-inf") else True  # unknown: stay strict
            self._required = (self._clock(), value)
        return value

    async def _record(self, keys: KeyStore, key_id: str) -> ApiKey | None:
        hit = self._known.get(key_id) or self._unknown.get(key_id)
        if hit is not None and self._clock() - hit[0] <= self._cache_s:
            return hit[1]
        task = self._inflight.get(key_id)
        if task is None:  # a burst with one key waits for one read, which no caller's cancel stops
            task = self._inflight[key_id] = asyncio.ensure_future(self._fetch(keys, key_id, hit))
            task.add_done_callback(lambda _: self._inflight.pop(key_id, None))
        return await asyncio.shield(task)

    async def _fetch(self, keys: KeyStore, key_id: str, hit: tuple[float, ApiKey | None] | None
                     ) -> ApiKey | None:
        try:
            record = await keys.get(key_id)
        except self._errors:
            if hit is None:
                raise Unavailable("API keys cannot be checked right now; retry shortly.",
                                  reason="auth_unavailable") from None
            return hit[1]  # the store is away: the last record seen stands
        keep, drop = (self._known, self._unknown) if record is not None else (self._unknown, self._known)
        keep.put(key_id, (self._clock(), record))
        drop.pop(key_id)  # a key created (or deleted) since
        self._on_size("known", len(self._known))
        self._on_size("unknown", len(self._unknown))
        return record

    def cache_sizes(self) -> dict[str, int]:
        """Entries held: known keys' records, and key ids the store did not know."""
        return {"known": len(self._known), "unknown": len(self._unknown)}

    async def authenticate(self, credential: str | None) -> Caller:
        if not credential:
            if await self.required():
                await self._refusing()
                raise Unauthenticated("You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
                                      reason="missing_api_key")
            return LOCAL
        keys = self._keys
        if keys is not None and (parts := split_key(credential)) is not None:
            if len(parts[0]) <= MAX_KEY_ID:
                record = await self._record(keys, parts[0])
                if record is not None and matches(record, parts[1]):
                    if not record.usable(self._wall()):
                        raise Unauthenticated("This API key has been revoked or has expired.",
                                              reason="key_revoked" if record.revoked_at is not None
                                              else "key_expired")
                    return Caller(tenant=record.tenant, subject=record.key_id, method="api_key",
                                  models=record.models)
        elif self._jwt is not None and credential.count(".") == 2:
            return await self._jwt.verify(credential)
        if not await self.required():
            return LOCAL  # local mode: any other credential (the SDK always sends one) is the default tenant
        await self._refusing()
        raise Unauthenticated("Incorrect API key provided.")

    async def recheck(self, caller: Caller) -> Caller:
        """A batch line's caller (who made the batch): its API key must still be usable, so a
        revoked key stops its batches' remaining lines. A JWT or local caller stands as found."""
        if caller.method != "api_key" or self._keys is None:
            return caller
        record = await self._record(self._keys, caller.subject)
        if record is None or not record.usable(self._wall()):
            raise Unauthenticated("The API key that created this batch has been revoked or has expired.",
                                  reason="key_revoked")
        return caller

    async def _refusing(self) -> None:
        """Before a 401: at most once per EMPTY_STORE_LOG_S, say in the log when the key
        store holds no key at all (flushed, evicted, a fresh store), so an operator sees why
        every API key is refused. Names no key and no credential."""
        now = self._clock()
        if self._keys is None or now - self._explained_at < EMPTY_STORE_LOG_S:
            return
        self._explained_at = now
        try:
            empty = not await self._keys.configured()
        except self._errors:
            return
        if empty:
            log.warning("request refused: credentials are required and the API key store holds no keys "
                        "(emptied, evicted or never filled); this never falls back to local mode. Create keys "
                        "with `llmesh keys create` against the gateways' store")


class _Lru:
    """At most ``size`` entries; the least recently used goes first."""
    __slots__ = ("_size", "_entries")

    def __init__(self, size: int):
        self._size = size
        self._entries: OrderedDict[str, tuple[float, ApiKey | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> tuple[float, ApiKey | None] | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: tuple[float, ApiKey | None]) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def pop(self, key: str) -> None:
        self._entries.pop(key, None)


class AuthenticateStage(Stage):
    def __init__(self, authenticator: Authenticator):
        self._auth = authenticator

    async def admit(self, ctx: Context) -> None:
        on_behalf = ctx.req.on_behalf
        caller = (await self._auth.authenticate(ctx.req.credential) if on_behalf is None
                  else await self._auth.recheck(on_behalf))
        ctx.req = replace(ctx.req, caller=caller, tenant=caller.tenant, credential=None)
        ctx.record.tenant = caller.tenant
        ctx.record.caller = caller.subject

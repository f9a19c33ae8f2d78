"""Shadow traffic: a copy of an alias's request goes to the shadow model version, and
both answers are compared and recorded (``llmesh.shadow``).

The copy is sent once the primary answer has been served in full (from the stage's
``finish``, which runs in the background), so it never delays the primary: the
client has its answer before the copy starts. Copies run at low priority in the
engines' queues; past the alias's ``max_concurrency`` copies in flight a new copy is
dropped (the first thing shed under load) and counted. A primary that failed or was
cancelled is not copied. The copy goes through the same masked prompt the primary's
engine saw (this stage runs after the guards).

The stage reaches the upstream through its wrap (``Context.wrap``), put on last so it
sees the answer the client gets (a cache hit, a cascade's): it keeps the primary's text
and the upstream's ``detached`` call, which sends the copy."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, Counter

from llmesh.background import Background
from llmesh.errors import LlmeshError
from llmesh.liveconfig.schema import MeshConfig, Shadow
from llmesh.shadow import Answer, ShadowRecord, ShadowStore, similarity, text_hash
from llmesh.types import Delta, Finish, Priority
from llmesh.gateway.context import Call, CompletionRequest, Context, Items, Slot, Upstream
from llmesh.gateway.stages.base import Stage

log = logging.getLogger("llmesh.gateway.shadow")
DROP_FLUSH_S = 1.0  # drop counts reach the store this long after the first unstored drop (and on close)


class ShadowMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.copies = Counter("llmesh_shadow_copies", "Shadow copies by alias and outcome "
                              "(recorded, failed: the shadow model did not answer, dropped: over max_concurrency).",
                              ("alias", "outcome"), registry=registry)
        self.store_errors = Counter("llmesh_shadow_store_errors", "Shadow records the store did not take.",
                                    registry=registry)


def sampled(request_id: str, share: float) -> bool:
    """A stable choice per request id: the same request is copied or not on any gateway."""
    return share >= 1.0 or (int(text_hash(request_id), 16) / 2**64) < share


@dataclass(slots=True)
class _Primary:
    """A sampled request: its answer's text as it passes, and the way to send the copy."""
    alias: str
    rule: Shadow
    req: CompletionRequest
    parts: list[str]
    copy: Call | None = None  # the upstream's detached call, once the answer is under way

    async def watch(self, req: CompletionRequest, upstream: Upstream) -> Items:
        self.copy = upstream.detached
        async with aclosing(upstream(req)) as items:
            async for item in items:
                if isinstance(item, Delta):
                    self.parts.append(item.text)
                yield item


class ShadowStage(Stage):
    def __init__(self, config: Callable[[], MeshConfig], store: ShadowStore, metrics: ShadowMetrics,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self._config = config
        self._primary: Slot[_Primary] = Slot("shadow")
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._wall = wall
        self._background = Background()
        self._in_flight: dict[str, int] = {}
        self._drops: dict[str, int] = {}
        self._flush_due = False

    async def admit(self, ctx: Context) -> None:
        rule = self._config().shadows.get(ctx.asked)
        if rule is None or ctx.req.embeds or not sampled(ctx.req.request_id, rule.sample):
            return  # shadows compare answers' texts: embeddings are not copied
        primary = _Primary(ctx.asked, rule, ctx.req, [])
        self._primary.put(ctx, primary)
        ctx.wrap(primary.watch)

    async def finish(self, ctx: Context) -> None:
        primary = self._primary.get(ctx)
        if primary is None or primary.copy is None or ctx.record.status != "ok":
            return
        alias, rule = primary.alias, primary.rule
        if self._in_flight.get(alias, 0) >= rule.max_concurrency:
            self._drop(alias)
            return
        self._in_flight[alias] = self._in_flight.get(alias, 0) + 1
        self._background.spawn(self._copy(primary, primary.copy, _answer_of(ctx, primary.parts)))

    def _drop(self, alias: str) -> None:
        self._metrics.copies.labels(alias, "dropped").inc()
        self._drops[alias] = self._drops.get(alias, 0) + 1
        if not self._flush_due:  # one store write a second at most, however many copies are shed
            self._flush_due = True
            self._background.spawn(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(DROP_FLUSH_S)
        self._flush_due = False
        await self._flush_drops()

    async def _flush_drops(self) -> None:
        drops, self._drops = self._drops, {}
        for alias, n in drops.items():
            try:
                await self._store.add_drops(alias, n)
            except Exception:  # a store outage loses counts, never a request (logged)
                self._metrics.store_errors.inc()
                log.warning("shadow drop count not stored", exc_info=True, extra={"alias": alias})

    async def _copy(self, primary: _Primary, upstream: Call, first: Answer) -> None:
        alias, model = primary.alias, primary.rule.model
        req = replace(primary.req, model=model, request_id=primary.req.request_id + "-shadow",
                      priority=Priority.LOW, continuation="")
        try:
            second, text = await self._call(upstream, req)
            self._metrics.copies.labels(alias, "recorded" if second.status == "ok" else "failed").inc()
            both = second.status == "ok"
            record = ShadowRecord(ts=self._wall(), alias=alias, primary=first, shadow=second,
                                  similarity=round(similarity("".join(primary.parts), text), 4) if both else None)
            try:
                await self._store.add(record)
            except Exception:  # a store outage loses the record, never a request (logged)
                self._metrics.store_errors.inc()
                log.warning("shadow record not stored", exc_info=True, extra={"alias": alias})
        finally:
            self._in_flight[alias] -= 1

    async def _call(self, upstream: Call, req: CompletionRequest) -> tuple[Answer, str]:
        started = self._clock()
        ttft, parts, finish, status = None, [], None, "ok"
        try:
            async with aclosing(upstream(req)) as items:
                async for item in items:
                    if ttft is None:
                        ttft = round((self._clock() - started) * 1000, 3)
                    if isinstance(item, Delta):
                        parts.append(item.text)
                    elif isinstance(item, Finish):
                        finish = item
        except LlmeshError as exc:
            status = exc.code.value
        text = "".join(parts)
        usage = finish.usage if finish is not None else None
        return Answer(model=req.model, status=status, latency_ms=round((self._clock() - started) * 1000, 3),
                      ttft_ms=ttft, prompt_tokens=usage.prompt_tokens if usage else 0,
                      completion_tokens=usage.completion_tokens if usage else 0, chars=len(text),
                      hash=text_hash(text)), text

    async def close(self) -> None:
        """Waits for copies in flight (and the drop counts' next write)."""
        await self._background.drain()


def _answer_of(ctx: Context, parts: list[str]) -> Answer:
    r = ctx.record
    text = "".join(parts)
    return Answer(model=r.model, status=r.status, latency_ms=r.duration_ms, ttft_ms=r.ttft_ms,
                  prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens, chars=len(text),
                  hash=text_hash(text))

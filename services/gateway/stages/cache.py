"""The response cache as a stage: a request the live config's ``cache`` section covers
(and that asks for no logprobs or tools) is looked up once every stage before has had
its say, so the cache sees the prompt the engines would (PII masked). A hit answers it
in one piece (``x-llmesh-cache: hit``; under load, degradation may ask for a looser
semantic threshold: ``Context.loose_cache``), spends no tokens and records the ones it
saved (the pipeline and the limits stage bill and count them); a miss's answer is stored once it is whole, in
the background. It goes after the stages that rewrite the request and before the
shadow stage, whose wrap then sees a hit like any answer."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing
from functools import partial
from typing import Protocol

from opentelemetry.trace import Span

from llmesh.background import Background
from llmesh.liveconfig.schema import MeshConfig, Price
from llmesh.types import Delta, Finish
from llmesh.gateway.context import CacheHit, CompletionRequest, Context, Items, Upstream, WholeAnswer
from llmesh.gateway.domain.quota import micro_usd
from llmesh.gateway.record import RequestRecord
from llmesh.gateway.stages.base import Stage

CACHE_HEADER = "x-llmesh-cache"


class ResponseCache(Protocol):
    def applies(self, req: CompletionRequest) -> bool: ...
    async def lookup(self, req: CompletionRequest, parent: Span, min_similarity: float | None = None
                     ) -> CacheHit | None: ...
    async def store(self, req: CompletionRequest, text: str, finish: Finish, parent: Span) -> None: ...


class CacheStage(Stage):
    def __init__(self, cache: ResponseCache, config: Callable[[], MeshConfig] = MeshConfig):
        self._cache = cache
        self._config = config  # the models' prices, for what a hit saved
        self._background = Background()

    async def admit(self, ctx: Context) -> None:
        req = ctx.req
        if req.embeds or req.sampling.logprobs is not None or req.tools is not None or not self._cache.applies(req):
            return
        loose = ctx.loose_cache
        hit = await self._cache.lookup(req, ctx.span, loose.min_similarity if loose is not None else None)
        if hit is None:
            ctx.record.cache = "miss"
            ctx.wrap(partial(self._store_after, ctx.span))
            return
        if hit.loosened and loose is not None:
            loose.served()  # degradation's policy, marked and counted there
        saved(ctx.record, hit, self._config().prices.get(req.model))
        ctx.headers[CACHE_HEADER] = "hit"  # HTTP header, gRPC metadata
        ctx.wrap(partial(_answer, hit.text, hit.finish))

    async def _store_after(self, span: Span, req: CompletionRequest, upstream: Upstream
                           ) -> Items:
        parts: list[str] = []
        async with aclosing(upstream(req)) as items:
            async for item in items:
                if isinstance(item, Delta):
                    parts.append(item.text)
                else:
                    self._background.spawn(self._cache.store(req, "".join(parts), item, span))
                yield item

    async def drain(self) -> None:
        await self._background.drain()


def saved(record: RequestRecord, hit: CacheHit, price: Price | None) -> None:
    """A hit on the record: its kind, and the cached answer's tokens (what producing it cost) as
    tokens not spent, priced as usage prices them. The record's own token counts stay 0."""
    usage = hit.finish.usage
    record.cache, record.cache_kind = "hit", hit.kind
    record.saved_prompt_tokens, record.saved_completion_tokens = usage.prompt_tokens, usage.completion_tokens
    record.saved_usd = micro_usd(price, usage.prompt_tokens, usage.completion_tokens) / 1e6


async def _answer(text: str, finish: Finish, req: CompletionRequest, upstream: Upstream
                  ) -> Items:
    yield WholeAnswer(text=text, tokens=finish.usage.completion_tokens)
    yield finish

"""The guards stage: a prompt-injection screen and PII masking before the prompt
leaves the gateway (engine, provider, cache, logs and spans only ever see placeholders;
tool-call arguments, tools' answers and the offered tools' descriptions and schemas included),
and on the way back the same PII rules on the model's answer, then, when the
tenant asks, its own values put back in place of the placeholders.

The work on the prompt is one ``screening.run``: on the event loop when the prompt is
light (``screening.light``: a few hundred microseconds at most), else in the guard
worker processes (``GuardWorkers``, with a deadline). The choices of one request
(``n`` > 1) share one run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import replace

from llmesh.errors import InvalidArgument
from llmesh.liveconfig.schema import Guards, MeshConfig
from llmesh.types import Message, Prompt
from llmesh.gateway.context import Context
from llmesh.gateway.domain.guards import screening
from llmesh.gateway.domain.guards.injection import MAX_SCAN_CHARS, MAX_SCAN_TOTAL_CHARS, InjectionScreen
from llmesh.gateway.domain.guards.pii import Placeholders, PiiMasker
from llmesh.gateway.domain.guards.pii_stream import StreamMasker, StreamRestorer
from llmesh.gateway.domain.guards.screening import GuardJob, GuardResult
from llmesh.gateway.stages.base import Stage

Offload = Callable[[GuardJob], Awaitable[GuardResult]]


class GuardStage(Stage):
    """``offload`` runs a heavy job elsewhere (``GuardWorkers.run``); without one every job
    runs inline. ``max_chars``/``max_total_chars``: the injection screen's caps."""

    def __init__(self, config: Callable[[], MeshConfig], masker: PiiMasker | None = None,
                 offload: Offload | None = None, max_chars: int = MAX_SCAN_CHARS,
                 max_total_chars: int = MAX_SCAN_TOTAL_CHARS):
        self._config = config
        self._masker = masker or PiiMasker()
        self._kinds = tuple(sorted(k.value for k in self._masker.kinds))
        self._offload = offload
        self._max_chars = max_chars
        self._max_total_chars = max_total_chars
        self._screens: dict[float, InjectionScreen] = {}

    def _screen(self, threshold: float) -> InjectionScreen:
        screen = self._screens.get(threshold)
        if screen is None:
            screen = self._screens[threshold] = InjectionScreen(
                threshold=threshold, action="flag", max_chars=self._max_chars, max_total_chars=self._max_total_chars)
        return screen

    async def admit(self, ctx: Context) -> None:
        guards = self._config().tenant(ctx.req.tenant).guards
        if ctx.req.inputs is not None:
            return await self._mask_inputs(ctx, guards)
        screened = guards.injection != "off"
        masking = guards.pii == "mask"
        job = GuardJob(ctx.req.prompt, guards.injection_threshold if screened else None,
                       self._kinds if masking else None, self._max_chars, self._max_total_chars,
                       ctx.req.tools if masking else None)
        result = await self._result(ctx, job) if screened or job.kinds is not None else None
        if result is not None and result.verdict is not None:
            self._judge(ctx, guards, result)
        placeholders, found = None, None
        if result is not None and job.kinds is not None:
            placeholders = result.placeholders.copy() if result.placeholders is not None else None
            if result.counts:
                ctx.record.pii = dict(result.counts)
                if result.prompt is not None:
                    ctx.req = replace(ctx.req, prompt=_own(ctx.req.prompt, result.prompt))
                if result.tools is not None:
                    ctx.req = replace(ctx.req, tools=result.tools)
            if guards.restore and result.found:
                found = result.found
        if guards.output_pii == "mask":
            ctx.filters.append(StreamMasker(self._masker, placeholders or Placeholders()))
        if found:
            ctx.filters.append(StreamRestorer(found))

    async def _mask_inputs(self, ctx: Context, guards: Guards) -> None:
        """An embeddings request: its inputs' PII masked as a prompt's is (the engine never sees
        it; the vectors are those of the masked texts). No injection screen: an embedding model
        follows no instructions. No output filters: vectors carry no text."""
        inputs = ctx.req.inputs
        if guards.pii != "mask" or not inputs:
            return
        prompt = Prompt(messages=tuple(Message("user", text) for text in inputs))
        result = await self._result(ctx, GuardJob(prompt, None, self._kinds, self._max_chars, self._max_total_chars))
        if result.counts and result.prompt is not None and result.prompt.messages is not None:
            ctx.record.pii = dict(result.counts)
            ctx.req = replace(ctx.req, inputs=tuple(m.content for m in result.prompt.messages))

    @staticmethod
    def _judge(ctx: Context, guards: Guards, result: GuardResult) -> None:
        verdict = result.verdict
        assert verdict is not None
        if verdict.rules:
            ctx.record.injection_score = round(verdict.score, 3)
            ctx.record.injection_rules = sorted(verdict.rules)
        if verdict.truncated:
            ctx.record.injection_truncated = True
        if verdict.score >= guards.injection_threshold and guards.injection == "block":
            raise InvalidArgument("The request was refused by the prompt-injection screen.",
                                  reason="prompt_injection", param="messages")

    async def _result(self, ctx: Context, job: GuardJob) -> GuardResult:
        """The job's result; the choices of one request share one run of it."""
        if ctx.shared is None:
            return await self._run(job)
        key = (GuardStage, job.threshold, job.kinds, _identity(job.prompt), id(job.tools))
        task = ctx.shared.get(key)
        if task is None:
            task = ctx.shared[key] = asyncio.ensure_future(self._run(job))
        return await asyncio.shield(task)

    async def _run(self, job: GuardJob) -> GuardResult:
        if self._offload is not None and not screening.light(job):
            return await self._offload(job)
        return screening.run(job, self._screen(job.threshold) if job.threshold is not None else None, self._masker)


def _identity(prompt: Prompt) -> Hashable:
    """The same for the choices' prompts (the same texts in the same roles), in constant time per
    message: by the texts' identity (the fronts parse a request once), not their value."""
    if prompt.messages is None:
        return id(prompt.text)
    return tuple((m.role, id(m.content), id(m.tool_calls), m.tool_call_id) for m in prompt.messages)


def _own(prompt: Prompt, masked: Prompt) -> Prompt:
    """``masked`` is the prompt of the choice that ran the job; this choice's own messages keep
    their own objects, with the masked texts and tool calls."""
    if prompt.messages is None or masked.messages is None or masked.messages is prompt.messages:
        return masked
    return Prompt(messages=tuple(m if m.content is n.content and m.tool_calls is n.tool_calls
                                 else replace(m, content=n.content, tool_calls=n.tool_calls)
                                 for m, n in zip(prompt.messages, masked.messages)))

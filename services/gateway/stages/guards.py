"""The guards stage: a prompt-injection screen and PII masking before the prompt
leaves the gateway (engine, cache, logs and spans only ever see placeholders),
and on the way back the same PII rules on the model's answer, then, when the
tenant asks, its own values put back in place of the placeholders."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from llmesh.errors import InvalidArgument
from llmesh.liveconfig.schema import MeshConfig
from llmesh.types import Prompt
from llmesh.gateway.context import Context
from llmesh.gateway.domain.guards.injection import InjectionScreen
from llmesh.gateway.domain.guards.pii import Masked, MaskedChat, Placeholders, PiiMasker
from llmesh.gateway.domain.guards.pii_stream import StreamMasker, StreamRestorer
from llmesh.gateway.stages.base import Stage


class GuardStage(Stage):
    def __init__(self, config: Callable[[], MeshConfig], masker: PiiMasker | None = None):
        self._config = config
        self._masker = masker or PiiMasker()
        self._screens: dict[float, InjectionScreen] = {}

    def _screen(self, threshold: float) -> InjectionScreen:
        screen = self._screens.get(threshold)
        if screen is None:
            screen = self._screens[threshold] = InjectionScreen(threshold=threshold, action="flag")
        return screen

    async def admit(self, ctx: Context) -> None:
        guards = self._config().tenant(ctx.req.tenant).guards
        prompt = ctx.req.prompt
        if guards.injection != "off":
            screen = self._screen(guards.injection_threshold)
            verdict = (screen.check(prompt.messages) if prompt.messages is not None
                       else screen.check_text(prompt.text or ""))
            if verdict.rules:
                ctx.record.injection_score = round(verdict.score, 3)
                ctx.record.injection_rules = sorted(verdict.rules)
            if verdict.score >= screen.threshold and guards.injection == "block":
                raise InvalidArgument("The request was refused by the prompt-injection screen.",
                                      reason="prompt_injection", param="messages")
        placeholders = None
        if guards.pii == "mask":
            masked: Masked | MaskedChat
            if prompt.messages is not None:
                masked = self._masker.mask_messages(prompt.messages)
                prompt = Prompt(messages=masked.messages)
            else:
                masked = self._masker.mask(prompt.text or "")
                prompt = Prompt(text=masked.text)
            placeholders = masked.placeholders
            if masked.counts:
                ctx.record.pii = dict(masked.counts)
                ctx.req = replace(ctx.req, prompt=prompt)
            if guards.restore and masked.found:
                found = masked.found
            else:
                found = None
        else:
            found = None
        if guards.output_pii == "mask":
            ctx.filters.append(StreamMasker(self._masker, placeholders or Placeholders()))
        if found:
            ctx.filters.append(StreamRestorer(found))

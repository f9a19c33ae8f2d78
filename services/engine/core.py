"""The engine core: checks a request against the model, waits for a slot, and turns
the backend's token stream into final text deltas, a finish reason and usage."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from llmesh.errors import ContextLengthExceeded, InvalidArgument, ModelNotFound
from llmesh.types import Delta, Finish, FinishReason, Prompt, Sampling, Usage
from llmesh.validation import check_request
from llmesh.engine.admission import Admission
from llmesh.engine.backends.base import Backend, DecodeParams
from llmesh.engine.stops import StopMatcher


@dataclass(frozen=True, slots=True)
class Defaults:
    temperature: float = 1.0
    top_p: float = 1.0


class EngineCore:
    def __init__(self, backend: Backend, admission: Admission, defaults: Defaults = Defaults()):
        self.backend = backend
        self.admission = admission
        self.defaults = defaults

    def count_tokens(self, model: str, prompt: Prompt) -> int:
        self._check_model(model)
        return len(self.backend.tokenize(prompt))

    async def generate(self, model: str, prompt: Prompt, sampling: Sampling
                       ) -> AsyncIterator[Delta | Finish]:
        """Yields Delta items, then exactly one Finish. Raises before the first
        item for a bad request or a full queue."""
        self._check_model(model)
        check_request(model, prompt, sampling)
        tokens = self.backend.tokenize(prompt)
        if not tokens:
            raise InvalidArgument("The prompt is empty.", param="messages" if prompt.is_chat else "prompt")
        params = self._decode_params(len(tokens), sampling)
        async with self.admission.slot(), aclosing(self._decode(tokens, params, sampling.stop)) as items:
            async for item in items:
                yield item

    async def _decode(self, tokens: list[int], params: DecodeParams, stop: tuple[str, ...]
                      ) -> AsyncIterator[Delta | Finish]:
        matcher = StopMatcher(stop)
        produced = 0
        pieces = self.backend.stream(tokens, params)
        try:
            async for piece in pieces:
                produced += 1
                text = matcher.feed(piece)
                if text or matcher.stopped:
                    yield Delta(text=text, tokens=1)
                if matcher.stopped:
                    break
        finally:
            await pieces.aclose()
        if matcher.stopped:
            reason = FinishReason.STOP
        else:
            rest = matcher.flush()
            if rest:
                yield Delta(text=rest, tokens=0)
            reason = FinishReason.LENGTH if produced >= params.max_new_tokens else FinishReason.STOP
        yield Finish(reason=reason, usage=Usage(prompt_tokens=len(tokens), completion_tokens=produced))

    def _check_model(self, model: str) -> None:
        if model != self.backend.model:
            raise ModelNotFound(model)

    def _decode_params(self, prompt_tokens: int, sampling: Sampling) -> DecodeParams:
        ctx = self.backend.context_length
        room = ctx - prompt_tokens
        if room <= 0:
            raise ContextLengthExceeded(prompt_tokens, prompt_tokens, ctx)
        if sampling.max_tokens is not None and sampling.max_tokens > room:
            raise ContextLengthExceeded(prompt_tokens, prompt_tokens + sampling.max_tokens, ctx)
        temperature = self.defaults.temperature if sampling.temperature is None else sampling.temperature
        top_p = self.defaults.top_p if sampling.top_p is None else sampling.top_p
        return DecodeParams(max_new_tokens=sampling.max_tokens or room, temperature=temperature,
                            top_p=top_p, seed=sampling.seed)

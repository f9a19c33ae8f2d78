"""A request's token ids, computed in the gateway exactly as the engine that would
serve it tokenizes it (same tokenizer and chat template), so prefix-aware picking
can hash them with each engine's scheme and needs no hop to the scheduler. GGUF
models in the gateway's model store use their own vocabulary; sim models the sim
tokenizer; any other model gets no tokens (prefix scoring then has no opinion)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from llmesh.modelstore import ModelStore
from llmesh.prompt_tokens import GgufChatTokenizer, sim_tokenize
from llmesh.types import Prompt

log = logging.getLogger("llmesh.gateway.prompt_tokens")


class PromptTokens:
    def __init__(self, model_dir: Path | None):
        self._store = ModelStore(model_dir) if model_dir else None
        self._tokenizers: dict[str, Callable[[Prompt], list[int]] | None] = {}

    def _tokenizer(self, model: str) -> Callable[[Prompt], list[int]] | None:
        if model not in self._tokenizers:
            tok = None
            if model.startswith("sim"):
                tok = sim_tokenize
            else:
                record = self._store.get(model) if self._store is not None else None
                if record is not None and record.format == "gguf":
                    try:
                        tok = GgufChatTokenizer(record.path)
                    except Exception:  # noqa: BLE001 - unreadable: no prefix scoring for it
                        log.warning("cannot read the tokenizer; no prefix-aware picking", extra={"model": model})
            self._tokenizers[model] = tok
        return self._tokenizers[model]

    def __call__(self, model: str, prompt: Prompt) -> list[int]:
        tok = self._tokenizer(model)
        return tok(prompt) if tok is not None else []

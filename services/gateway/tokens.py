"""Counting a prompt's tokens before admission, with the model's own tokenizer
where the gateway can read the model (a GGUF in its model store: vocabulary only,
~0.2 s to load, once per model), else an estimate of 1 token per 3 bytes. The
chat template's framing is estimated at 4 tokens per message plus 3; the count is
reconciled with the engine's exact one when the request ends."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from llmesh.modelstore import ModelStore, quiet_native_stderr
from llmesh.types import Prompt

log = logging.getLogger("llmesh.gateway.tokens")

PER_MESSAGE = 4
PER_REPLY = 3


class TokenCounter:
    def __init__(self, model_dir: Path | None):
        self._store = ModelStore(model_dir) if model_dir else None
        self._vocabs: dict[str, object | None] = {}

    def _vocab(self, model: str):
        if model not in self._vocabs:
            vocab = None
            record = self._store.get(model) if self._store is not None else None
            if record is not None and record.format == "gguf":
                try:
                    from llama_cpp import Llama
                    with quiet_native_stderr():
                        vocab = Llama(model_path=str(record.path), vocab_only=True, verbose=False)
                except Exception:  # noqa: BLE001 - an unreadable model falls back to the estimate
                    log.warning("cannot read the tokenizer", extra={"model": model})
            self._vocabs[model] = vocab
        return self._vocabs[model]

    def count(self, model: str, prompt: Prompt) -> int:
        vocab = self._vocab(model)
        texts = [m.content for m in prompt.messages] if prompt.messages is not None else [prompt.text or ""]
        if vocab is not None:
            n = sum(len(vocab.tokenize(t.encode(), add_bos=False, special=False)) for t in texts if t)
        else:
            n = sum(math.ceil(len(t.encode()) / 3) for t in texts)
        if prompt.messages is not None:
            n += PER_MESSAGE * len(prompt.messages) + PER_REPLY
        return n

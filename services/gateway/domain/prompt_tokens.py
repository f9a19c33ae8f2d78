"""A request's token ids, computed in the gateway exactly as the engine that would
serve it tokenizes it (same tokenizer and chat template), so prefix-aware picking
can hash them with each engine's scheme and needs no hop to the scheduler. GGUF
models in the gateway's model store use their own vocabulary; Hugging Face model
directories there (what vLLM engines serve) their tokenizer.json and chat template;
sim models the sim tokenizer; any other model gets no tokens (prefix scoring then
has no opinion)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from llmesh.modelstore import ModelStore
from llmesh.prompt_tokens import GgufChatTokenizer, HfChatTokenizer, hf_model_dir, sim_tokenize
from llmesh.types import Prompt

log = logging.getLogger("llmesh.gateway.prompt_tokens")


def _plain(name: str) -> bool:
    """A model name that names a folder of the store (not a path)."""
    return bool(name.strip(".")) and "/" not in name


class PromptTokens:
    def __init__(self, model_dir: Path | None):
        self._store = ModelStore(model_dir) if model_dir else None
        self._tokenizers: dict[str, Callable[[Prompt], list[int]] | None] = {}

    def _tokenizer(self, model: str) -> Callable[[Prompt], list[int]] | None:
        if model not in self._tokenizers:
            tok = None
            if model.startswith("sim"):
                tok = sim_tokenize
            elif self._store is not None and _plain(model) and hf_model_dir(self._store.root / model):
                try:  # read before the store's record: that would checksum every weight file
                    tok = HfChatTokenizer(self._store.root / model)
                except Exception:  # noqa: BLE001 - unreadable: no prefix scoring for it
                    log.warning("cannot read the tokenizer; no prefix-aware picking", extra={"model": model})
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

    def floor(self, model: str, prompt: Prompt, enough: int) -> int:
        """At least this many tokens are in ``prompt`` for ``model`` (0: nothing known), found in time
        that does not grow with the prompt past ``enough`` tokens: counting stops there. The sim
        tokenizer counts words ("role:" and each word of the content), so its floor is the count of
        the first ``enough`` + 1 words; a GGUF's tokens are at most its longest token's bytes long,
        so a text of n characters has at least n / that many. Tokenizing the prompt itself costs
        time in its length, and more (llama.cpp's special-token split is quadratic: 1 MB of
        "<|im_start|>" took 100 s), so it comes after a prompt over the context is refused."""
        tok = self._tokenizer(model)
        parts = [m.content for m in prompt.messages] if prompt.messages is not None else [prompt.text or ""]
        if tok is sim_tokenize:
            counted = len(parts) if prompt.messages is not None else 0  # each message's "role:"
            for text in parts:
                if counted > enough:
                    break
                counted += len(text.split(None, enough - counted + 1))
            return counted
        longest = getattr(tok, "longest_token", 0)
        return -(-sum(map(len, parts)) // longest) if longest else 0

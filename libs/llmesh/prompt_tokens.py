"""A prompt's token ids exactly as an engine sees them, for a router that must name
the KV blocks an engine would cache for a request without asking it (the hashing
itself: ``llmesh.kvhash``). Engines and gateways share these, so the names agree.

- ``sim_tokenize``: the sim backend's tokenizer (one token per word of "role: content").
- ``GgufChatTokenizer``: a GGUF's vocabulary and chat template, as llama.cpp applies them."""

from __future__ import annotations

import ctypes
import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, cast

from llmesh.types import Prompt

if TYPE_CHECKING:
    from llama_cpp.llama_types import ChatCompletionRequestMessage

def sim_token(word: str) -> int:
    return int.from_bytes(hashlib.blake2s(word.encode(), digest_size=2).digest(), "big")


def sim_tokenize(prompt: Prompt) -> list[int]:
    if prompt.messages is not None:
        text = " ".join(f"{m.role}: {m.content}" for m in prompt.messages)
    else:
        text = prompt.text or ""
    return [sim_token(w) for w in text.split()]


class GgufChatTokenizer:
    """Vocabulary only (~0.2 s to load); the chat template is rendered as llama.cpp's
    Jinja2 formatter does and tokenized with special tokens parsed."""

    def __init__(self, path: Path):
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        from llmesh.modelstore import quiet_native_stderr
        with quiet_native_stderr():
            self.vocab = Llama(model_path=str(path), vocab_only=True, verbose=False)
        template = self.vocab.metadata.get("tokenizer.chat_template")
        if not template:
            raise ValueError(f"{path}: the GGUF carries no chat template")
        self._formatter = Jinja2ChatFormatter(template=template, eos_token=self._special(self.vocab.token_eos()),
                                              bos_token=self._special(self.vocab.token_bos()))

    @functools.cached_property
    def longest_token(self) -> int:
        """Bytes in the vocabulary's longest token, special tokens included (the chat template's text
        is tokenized with them parsed): a text of n characters has at least n / this many tokens.
        Read once per model (~50k calls into llama.cpp, a few tens of milliseconds)."""
        import llama_cpp

        model = self.vocab._model
        buf = ctypes.create_string_buffer(1024)
        longest = 1
        for token in range(model.n_vocab()):
            longest = max(longest, abs(llama_cpp.llama_token_to_piece(model.vocab, token, buf, len(buf), 0, True)))
        return longest

    def _special(self, token: int) -> str:
        return self.vocab.detokenize([token], special=True).decode("utf-8", "replace") if token >= 0 else ""

    def __call__(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            # the roles were validated upstream; llama.cpp's types want one TypedDict per role
            messages = cast("list[ChatCompletionRequestMessage]",
                            [{"role": m.role, "content": m.content} for m in prompt.messages])
            text = self._formatter(messages=messages).prompt
            return self.vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        return self.vocab.tokenize((prompt.text or "").encode("utf-8"), add_bos=True, special=False)

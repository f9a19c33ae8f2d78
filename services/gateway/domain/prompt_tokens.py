"""A request's token ids, computed in the gateway exactly as the engine that would
serve it tokenizes it (same tokenizer and chat template), so prefix-aware picking
can hash them with each engine's scheme and needs no hop to the scheduler. GGUF
models in the gateway's model store use their own vocabulary; Hugging Face model
directories there (what vLLM engines serve) their tokenizer.json and chat template;
sim models the sim tokenizer; any other model gets no tokens (prefix scoring then
has no opinion).

A real tokenizer costs ~1.6 us a token here (llama.cpp's; a 16k-token chat took 26 ms) and its
chat template ~75 us a message, so ``ahead`` tokenizes a long prompt on a thread of its own: both
real tokenizers let go of the GIL while they work, and the event loop's other streams go on
meanwhile. The sim tokenizer is Python (it holds the GIL) and stays on the loop."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from llmesh.modelstore import ModelStore
from llmesh.prompt_tokens import GgufChatTokenizer, HfChatTokenizer, hf_model_dir, sim_tokenize
from llmesh.tool_prompt import render
from llmesh.types import Prompt, Tools

log = logging.getLogger("llmesh.gateway.prompt_tokens")
# A prompt is tokenized on a thread from this much work on: its characters, and for each message as many
# characters as rendering it through the chat template costs (~75 us: a 12-message chat of 47 characters
# took 0.9 ms, a 2-message question 0.26 ms). On a thread, the event loop's own share of a tokenization
# is ~55 us; the request waits ~130 us more.
AHEAD_CHARS = 1024
MESSAGE_CHARS = 200
THREADS = 2


class Tokenizer(Protocol):
    """Tokens by model, as the engines serving it count them (``PromptTokens``), or none (``NoTokens``)."""

    def __call__(self, model: str, prompt: Prompt) -> Sequence[int]: ...

    async def ahead(self, model: str, prompts: Sequence[Prompt]) -> list[Sequence[int]] | None:
        """Each prompt's tokens, worked out off the event loop where that pays; None: tokenize them in place."""
        ...


class NoTokens:
    """No tokenizer for any model: picks and limits go by estimates."""

    def __call__(self, model: str, prompt: Prompt) -> Sequence[int]:
        return ()

    async def ahead(self, model: str, prompts: Sequence[Prompt]) -> list[Sequence[int]] | None:
        return None


class RequestTokens:
    """One request's prompt tokens for each model it may go to, worked out once for all its picks
    (a retry, a failover to another engine, a fallback model's) and its limits' count. A long
    prompt's are worked out by ``ready``, off the event loop where the tokenizer can (``ahead``);
    a short one's when first needed."""

    def __init__(self, tokenizer: Tokenizer, prompt: Prompt, tools: Tools | None = None) -> None:
        self._tokenizer, self._chat, self._tools = tokenizer, prompt, tools
        self._ids: dict[str, Sequence[int]] = {}

    @functools.cached_property
    def prompt(self) -> Prompt:
        """The chat as an engine sees it: the offered tools in its system message (``render``)."""
        return render(self._chat, self._tools)

    def serves(self, chat: Prompt, tools: Tools | None) -> bool:
        """Whether these are the tokens of ``chat`` with ``tools`` (the same objects: a stage that
        changes a request's prompt, as masking does, makes new ones)."""
        return chat is self._chat and tools is self._tools

    async def ready(self, model: str) -> None:
        """Tokenizes the prompt for ``model`` now, on a thread, if it is long enough to be worth it."""
        if model not in self._ids and (ids := await self._tokenizer.ahead(model, (self.prompt,))) is not None:
            self._ids[model] = ids[0]

    def of(self, model: str) -> Callable[[], Sequence[int]]:
        """The prompt's tokens for ``model``, when called: those ``ready`` found, else tokenized then."""
        def tokens() -> Sequence[int]:
            if model not in self._ids:
                self._ids[model] = self._tokenizer(model, self.prompt)
            return self._ids[model]
        return tokens


def worth_a_thread(prompts: Sequence[Prompt]) -> bool:
    """Whether tokenizing ``prompts`` costs enough to go to a thread (``AHEAD_CHARS``): an embeddings
    request's many short inputs may, together."""
    return sum(_work(p) for p in prompts) >= AHEAD_CHARS


def _work(prompt: Prompt) -> int:
    if prompt.messages is None:
        return len(prompt.text or "")
    return sum(len(m.content) + MESSAGE_CHARS for m in prompt.messages)


def _plain(name: str) -> bool:
    """A model name that names a folder of the store (not a path)."""
    return bool(name.strip(".")) and "/" not in name


class PromptTokens:
    def __init__(self, model_dir: Path | None):
        self._store = ModelStore(model_dir) if model_dir else None
        self._tokenizers: dict[str, Callable[[Prompt], list[int]] | None] = {}
        self._pool: ThreadPoolExecutor | None = None

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

    async def ahead(self, model: str, prompts: Sequence[Prompt]) -> list[Sequence[int]] | None:
        """Each prompt's tokens for ``model``, worked out in one trip to a thread, when together they
        are long enough to hold the event loop (``worth_a_thread``) and the tokenizer lets go of the
        GIL; None otherwise (the caller tokenizes them in place, when it needs the tokens)."""
        if not worth_a_thread(prompts):
            return None
        tok = self._tokenizer(model)
        if tok is None or tok is sim_tokenize:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: [tok(p) for p in prompts])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def floor(self, model: str, prompt: Prompt, enough: int) -> int:
        """At least this many tokens are in ``prompt`` for ``model`` (0: nothing known), found in time
        that does not grow with the prompt past ``enough`` tokens: counting stops there. The sim
        tokenizer counts words ("role:" and each word of the content, then the answer's header), so
        its floor is the count of the first ``enough`` + 1 words; a GGUF's tokens are at most its
        longest token's bytes long, so a text of n characters has at least n / that many. Tokenizing
        the prompt itself costs time in its length, and more (llama.cpp's special-token split is
        quadratic: 1 MB of "<|im_start|>" took 100 s), so it comes after a prompt over the context
        is refused."""
        tok = self._tokenizer(model)
        parts = [m.content for m in prompt.messages] if prompt.messages is not None else [prompt.text or ""]
        if tok is sim_tokenize:
            counted = len(parts) + 1 if prompt.messages is not None else 0  # each "role:", "assistant:"
            for text in parts:
                if counted > enough:
                    break
                counted += len(text.split(None, enough - counted + 1))
            return counted
        longest = getattr(tok, "longest_token", 0)
        return -(-sum(map(len, parts)) // longest) if longest else 0

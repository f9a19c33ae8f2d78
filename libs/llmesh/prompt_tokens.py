"""A prompt's token ids exactly as an engine sees them, for a router that must name
the KV blocks an engine would cache for a request without asking it (the hashing
itself: ``llmesh.kvhash``). Engines and gateways share these, so the names agree.

- ``sim_tokenize``: the sim backend's tokenizer (one token per word of "role: content", then the
  answer's header).
- ``GgufChatTokenizer``: a GGUF's vocabulary and chat template, as llama.cpp applies them.
- ``HfChatTokenizer``: a Hugging Face model directory's tokenizer.json and chat template, as
  vLLM applies them (transformers' ``apply_chat_template``)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from llmesh.types import Message, Prompt

if TYPE_CHECKING:
    from llama_cpp.llama_types import ChatCompletionRequestMessage

SIM_WORD_MEMO = 32  # words up to this long keep their token in a memo (bounded: 12.7 MB full of 32-letter words)


def sim_token(word: str) -> int:
    return _memo_token(word) if len(word) <= SIM_WORD_MEMO else _token(word)


def _token(word: str) -> int:
    return int.from_bytes(hashlib.blake2s(word.encode(), digest_size=2).digest(), "big")


# a chat repeats its words (and its whole history, turn after turn): a memo hit takes ~90 ns, a hash ~560
_memo_token = functools.lru_cache(maxsize=1 << 16)(_token)


def sim_chat_words(messages: Iterable[Message]) -> list[str]:
    """A chat as the sim renders it: "role: content" for each message, then the answer's header
    (``assistant:``), as a chat template's generation prompt ends it. So the next turn's history
    repeats this prompt and the answer generated after it word for word, and can hit the blocks
    that answer filled."""
    return " ".join([f"{m.role}: {m.content}" for m in messages] + ["assistant:"]).split()


def sim_tokenize(prompt: Prompt) -> list[int]:
    words = sim_chat_words(prompt.messages) if prompt.messages is not None else (prompt.text or "").split()
    return [sim_token(w) for w in words]


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


def hf_model_dir(folder: Path) -> bool:
    """Whether ``folder`` holds a Hugging Face model's tokenizer (as vLLM loads it)."""
    return (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()


def _special_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HfChatTokenizer:
    """A Hugging Face model directory's tokenizer (tokenizer.json, read by the ``tokenizers``
    library transformers' fast tokenizers wrap) and chat template (chat_template.jinja, else
    tokenizer_config.json's ``chat_template``), applied as transformers' ``apply_chat_template``
    does for vLLM: rendered by a sandboxed Jinja2 with trim_blocks and lstrip_blocks, the special
    tokens named in the config as variables, then tokenized without adding special tokens. A
    plain text prompt is encoded with them, as ``tokenizer.encode`` does."""

    def __init__(self, folder: Path):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        template = ((folder / "chat_template.jinja").read_text() if (folder / "chat_template.jinja").is_file()
                    else config.get("chat_template"))
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str) or not template:
            raise ValueError(f"{folder}: the model carries no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template)
        self._specials = {name: text for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                          if (text := _special_text(config.get(name))) is not None}

    @functools.cached_property
    def longest_token(self) -> int:
        """At least the bytes of the vocabulary's longest token, special tokens included: its
        longest entry as the vocabulary spells it (byte-level "Ġ", SentencePiece's "▁" and byte
        fallback's "<0xE2>" each take at least the bytes they stand for). 0 (no floor) where
        the tokenizer may drop text before it splits it (a Whitespace pre-tokenizer, a Strip
        normalizer): a text's tokens then need not cover its characters."""
        spec = json.loads(self._tokenizer.to_str())
        if not (_keeps_text(spec.get("pre_tokenizer"), "pretokenizers")
                and _keeps_text(spec.get("normalizer"), "normalizers")):
            return 0
        return max((len(t.encode("utf-8")) for t in self._tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def __call__(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            text = self._template.render(messages=[{"role": m.role, "content": m.content} for m in prompt.messages],
                                         add_generation_prompt=True, tools=None, documents=None, **self._specials)
            return self._encode(text, False)
        return self._encode(prompt.text or "", True)

    def _encode(self, text: str, special: bool) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it), so a long prompt
        # tokenized on a thread does not stop the event loop's own thread
        return list(self._tokenizer.encode_batch([text], add_special_tokens=special)[0].ids)


# Pre-tokenizers and normalizers that keep every character of the text (a Split unless its behaviour
# is "Removed", a Replace unless by nothing); anything else may drop some.
_KEEPING = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split",
                      "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace", "Precompiled"})


def _keeps_text(part: dict[str, Any] | None, members: str) -> bool:
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p, members) for p in part.get(members, []))
    return kind in _KEEPING and part.get("behavior") != "Removed" and part.get("content") != ""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)

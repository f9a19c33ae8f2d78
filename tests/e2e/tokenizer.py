"""An independent count of SmolLM2 prompt tokens for the tests: the GGUF's own chat
template rendered with plain Jinja2, tokenized by llama.cpp's vocabulary."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import jinja2
from llama_cpp import Llama

from llmesh.modelstore import quiet_native_stderr


@cache
def vocab(gguf: Path) -> Llama:
    with quiet_native_stderr():
        return Llama(model_path=str(gguf), vocab_only=True, verbose=False)


def chat_prompt_tokens(gguf: Path, messages: list[dict]) -> int:
    llm = vocab(gguf)
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(
        llm.metadata["tokenizer.chat_template"])
    text = template.render(messages=messages, add_generation_prompt=True)
    return len(llm.tokenize(text.encode(), add_bos=False, special=True))


def text_tokens(gguf: Path, text: str) -> int:
    return len(vocab(gguf).tokenize(text.encode(), add_bos=False, special=False))

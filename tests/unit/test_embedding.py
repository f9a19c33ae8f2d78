"""The shared embedder (llmesh.embedding) on the real all-MiniLM-L6-v2: batches of texts of any
lengths give each text's own vector (the padding changes nothing), in order; ``encode``
truncates as sentence-transformers does, ``tokenize`` does not, and ``encode_ids`` refuses
more than the model takes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

REFERENCE = json.loads((Path(__file__).resolve().parents[1] / "data" / "minilm_reference.json").read_text())


def test_a_batch_gives_each_text_its_reference_vector_in_order(minilm):
    texts = REFERENCE["texts"] + ["word " * 200]
    ids = minilm.tokenize_many(texts)
    assert [len(i) for i in ids] == [len(minilm.tokenize(t)) for t in texts]
    together = minilm.encode_many(ids, batch_tokens=64)  # several batches, the long text alone
    alone = np.stack([minilm.encode_ids(i) for i in ids])
    assert together.dtype == np.float32 and together.shape == (len(texts), minilm.dim)
    assert np.abs(together - alone).max() < 1e-6
    assert np.abs(together[:-1] - np.asarray(REFERENCE["vectors"], dtype=np.float32)).max() < 1e-5
    assert np.allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)


def test_encode_truncates_as_sentence_transformers_and_encode_ids_refuses(minilm, minilm_dir):
    long = "word " * 400
    ids = minilm.tokenize(long)
    assert len(ids) == 402 and minilm.max_tokens == 256  # [CLS] ... [SEP], not truncated
    truncating = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    truncating.enable_truncation(256)  # what sentence-transformers' tokenizer does with max_seq_length
    assert np.array_equal(minilm.encode(long), minilm.encode_ids(truncating.encode(long).ids))
    for bad in ([], ids):
        with pytest.raises(ValueError, match="the model takes 1 to 256"):
            minilm.encode_ids(bad)

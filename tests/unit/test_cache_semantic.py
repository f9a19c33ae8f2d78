"""The real all-MiniLM-L6-v2 on numpy against sentence-transformers' own vectors, the
guards on the near misses a cosine threshold lets through, and the per-scope index."""

import json
from pathlib import Path

import numpy as np
import pytest

from llmesh.cache.guards import extract, refusal
from llmesh.cache.index import ScopeIndex
from llmesh.cache.semantic import SemanticIndex
from llmesh.cache.store import Name, Selector

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "minilm_reference.json"


def test_embeddings_match_sentence_transformers(minilm):
    ref = json.loads(REFERENCE.read_text())
    for text, expected in zip(ref["texts"], ref["vectors"]):
        got = minilm.encode(text)
        assert got.dtype == np.float32 and got.shape == (384,)
        assert np.abs(got - np.asarray(expected, dtype=np.float32)).max() < 1e-5, text


@pytest.mark.parametrize("a, b, guard", [
    ("Convert 5 miles to km", "Convert 50 miles to km", "number"),
    ("Give me three ideas", "Give me ten ideas", "number"),
    ("给我三个点子", "给我五个点子", "number"),
    ("Convert 5 miles to km", "Convert 5 km to miles", "unit"),
    ("30摄氏度是多少华氏度？", "30华氏度是多少摄氏度？", "unit"),
    ("How do I enable notifications?", "How do I disable notifications?", "direction"),
    ("How do I turn on dark mode?", "How do I turn off dark mode?", "direction"),
    ("Which plants need sunlight?", "Which plants don't need sunlight?", "negation"),
    ("哪些国家需要签证？", "哪些国家不需要签证？", "negation"),
    ("Delete the first line.", "Delete the last line.", "scope"),
    ("What is the capital of France?", "What is the capital of Germany?", "entity"),
    ("What does `git reset --hard` do?", "What does `git reset --soft` do?", "code"),
    ("Tell me a joke about cats.", "Tell me a joke about dogs.", "content"),
    ("杭州有什么好玩的地方？", "苏州有什么好玩的地方？", "content"),
])
def test_guards_refuse_near_misses(a, b, guard):
    assert refusal(extract(a), extract(b)) == guard


@pytest.mark.parametrize("a, b", [
    ("How do I reset my password?", "How can I reset my password?"),
    ("what is the capital of france", "What is the capital of France?"),
    ("What is 15% of 200?", "What's 15 percent of 200?"),
    ("Is the store open on Sunday?", "Is the store open on Sundays?"),
    ("是否需要签证？", "需要签证吗？"),  # 是否 asks, it does not deny
    ("如何重置我的密码？", "我的密码怎么重置？"),
])
def test_guards_let_paraphrases_through(a, b):
    assert refusal(extract(a), extract(b)) is None


def test_scope_index_moves_to_hnsw_and_finds_the_same_neighbours():
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(300, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    small, big = ScopeIndex(hnsw_min=10_000), ScopeIndex(hnsw_min=50)
    for i, v in enumerate(vectors):
        small.add(i + 1, v)
        big.add(i + 1, v)
    query = vectors[42] + 0.05 * rng.normal(size=384).astype(np.float32)
    query /= np.linalg.norm(query)
    exact, approx = small.search(query, 3), big.search(query, 3)
    assert exact[0].label == approx[0].label == 43
    assert abs(exact[0].similarity - approx[0].similarity) < 1e-4
    big.remove(43)
    small.remove(43)
    assert big.search(query, 1)[0].label == small.search(query, 1)[0].label != 43


def test_semantic_index_searches_one_scope_and_applies_threshold_and_guards(minilm):
    refused = []
    index = SemanticIndex(minilm, on_refusal=refused.append)
    stored = "How do I reset my password?"
    index.add(Name("t", "m", "s", "01"), "scope-a", stored, index.embed(stored), ttl_s=60)
    index.add(Name("t", "m", "s", "02"), "scope-a", "Convert 5 miles to km", index.embed("Convert 5 miles to km"),
              ttl_s=60)

    def find(text, scope="scope-a", threshold=0.85):
        return [c.name.digest for c in index.search(scope, text, index.embed(text), threshold)]

    assert find("How can I reset my password?") == ["01"]
    assert find("How can I reset my password?", scope="scope-b") == []
    assert find("How can I reset my password?", threshold=0.999) == []
    assert find("Convert 50 miles to km") == [] and refused == ["number"]
    assert index.remove_matching(Selector(prefix="02")) == 1 and len(index) == 1


def test_a_batch_with_a_name_twice_keeps_one_entry(minilm):
    index = SemanticIndex(minilm, hnsw_min=2)
    v = index.embed("How do I reset my password?")
    name = Name("t", "m", "s", "01")
    index.add_many([(name, "s", "How do I reset my password?", v, 60),
                    (name, "s", "How do I reset my password?", v, 60),
                    (Name("t", "m", "s", "02"), "s", "How do I reset my password?", v, 60)])
    assert len(index) == 2
    assert {c.name.digest for c in index.search("s", "How do I reset my password?", v, 0.9)} == {"01", "02"}

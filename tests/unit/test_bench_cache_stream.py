"""bench.cache_stream's FAQ stream: the base questions first, then a Zipf-like mix of repeats,
paraphrases and near-misses, each labelled with what the cache may do; the tally from answers."""

from bench.cache_stream import stream_events, tally

ROWS = [{"hit": True, "a": f"q{i}", "b": f"q{i} para"} for i in range(6)] + \
       [{"hit": False, "a": f"q{i}", "b": f"q{i} near"} for i in range(6)]


def test_stream_starts_with_the_base_set_and_labels_each_event():
    events = stream_events(ROWS, 400, seed=3)
    assert sorted(e["text"] for e in events[:6]) == [f"q{i}" for i in range(6)]
    assert all(e["expect"] == "miss" for e in events[:6]) and len(events) == 406
    seen: set[str] = set()
    for e in events:
        if e["text"] in seen:
            assert e["expect"] == "hit"
        elif e["type"] == "paraphrase":
            assert e["expect"] == "may_hit" and e["text"].endswith("para")
        elif e["type"] == "near_miss":
            assert e["expect"] == "must_miss" and e["text"].endswith("near")
        seen.add(e["text"])
    kinds = [e["type"] for e in events[6:]]
    assert 0.4 < kinds.count("repeat") / 400 < 0.6 and kinds.count("near_miss") > 40
    ranks = [sum(e["of"] == f"q{i}" for e in events[6:]) for i in range(6)]
    assert max(ranks) > 2 * min(ranks)  # Zipf-like: some questions far more often
    assert stream_events(ROWS, 400, seed=3) == events  # reproducible


def test_tally_counts_false_hits_from_first_near_misses():
    events = [{"expect": "miss", "hit": False}, {"expect": "hit", "hit": True}, {"expect": "hit", "hit": False},
              {"expect": "may_hit", "hit": True}, {"expect": "must_miss", "hit": True},
              {"expect": "must_miss", "hit": False}]
    out = tally(events)
    assert out["hits"] == 3 and out["exact_hit_rate"] == 0.5 and out["semantic_hit_rate"] == 1.0
    assert out["false_hits"] == 1 and out["false_hit_rate"] == 0.5 and out["hit_rate"] == 0.5

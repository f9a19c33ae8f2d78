"""The content guard's tolerance: typos and inflections pass, swapped words do not (new words)."""

from llmesh.cache.guards import extract, refusal
from llmesh.cache.lexical import MAX_PAIRING, edits, near, swapped


def test_edits_counts_insertions_deletions_substitutions_and_transpositions():
    assert edits("harbour", "harbor", 2) == 1
    assert edits("glacier", "galcier", 2) == 1
    assert edits("walnut", "wolnut", 2) == 1
    assert edits("pumpkin", "pumpkin", 1) == 0
    assert edits("zebra", "cobra", 1) == 2  # over the cap: cap + 1


def test_near_twins():
    assert near("telescpe", "telescope")
    assert near("recieve", "receive")
    assert near("harvest", "harvested")     # an inflection: the prefix with at most 3 letters more
    assert near("compatibilty", "compatability")  # two edits allowed from 8 letters on
    assert not near("otter", "oyster")      # two edits in a short word
    assert not near("ferry", "berry")       # typos keep the first letter
    assert not near("tram", "trap")         # under 5 letters only the prefix rule applies
    assert not near("pine", "pineapple")    # too many letters more for an inflection


def test_swapped_needs_an_unmatched_word_on_both_sides():
    assert swapped(frozenset({"otter", "river"}), frozenset({"beaver", "river"}))
    assert not swapped(frozenset({"glacier", "melt"}), frozenset({"galcier", "melt"}))
    assert not swapped(frozenset({"river"}), frozenset({"river", "muddy"}))  # an added word
    many_a = frozenset(f"alpha{i}" for i in range(MAX_PAIRING + 1))
    many_b = frozenset(f"alpha{i}x" for i in range(MAX_PAIRING + 1))
    assert swapped(many_a, many_b)  # past the pairing cap, taken as different


def test_the_content_guard_on_whole_questions():
    assert refusal(extract("How do I prune a walnut tree?"), extract("how do i prnue a walnut tree")) is None
    assert refusal(extract("How do I prune a walnut tree?"), extract("How do I prune a cherry tree?")) == "content"
    # polite request verbs and pronouns carry no content
    assert refusal(extract("I would like to know how they prune a walnut tree."),
                   extract("how do you prune a walnut tree")) is None


def test_long_words_are_not_paired_by_edits():
    blob = "q" * 5000
    assert not near(blob + "a", blob + "b")
    assert swapped(frozenset({blob + "a", "tree"}), frozenset({blob + "b", "tree"}))

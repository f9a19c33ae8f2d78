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
    assert near("compatibilty", "compatability")  # two edits allowed from 10 letters on
    assert not near("tasmania", "tanzania")    # but one only under 10
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


def test_covered_names_allow_a_near_twin():
    from llmesh.cache.lexical import covered
    assert covered(frozenset({"marseille"}), frozenset({"marseile", "port"}))
    assert not covered(frozenset({"marseille"}), frozenset({"lyon", "port"}))


def test_poles_conflict_on_a_shared_scale_only():
    from llmesh.cache.lexical import poles_conflict
    assert poles_conflict(frozenset({"toggle+"}), frozenset({"toggle-"}))
    assert poles_conflict(frozenset({"compass_n"}), frozenset({"compass_e"}))
    assert not poles_conflict(frozenset({"toggle+"}), frozenset({"toggle+", "temp-"}))
    assert not poles_conflict(frozenset({"toggle+"}), frozenset())


def test_direction_words_one_side_lacks():
    # opposite poles, and one direction word in place of another, are refused
    assert refusal(extract("How do I encrypt a zip archive?"),
                   extract("How do I decrypt a zip archive?")) == "direction"
    assert refusal(extract("How do I raise the awning?"), extract("How do I lower the awning?")) == "direction"
    # a direction word in a pleasantry the other question lacks is not
    assert refusal(extract("hey, am I right that you know? how do I waterproof boots?"),
                   extract("How do I waterproof boots?")) is None
    # ... but one the other replaces with a content word is
    assert refusal(extract("How do I install the wallpaper?"), extract("How do I hang the wallpaper?")) == "direction"


def test_negations_are_counted():
    assert extract("哪些背包支持无条件换货").negations == 1
    assert refusal(extract("哪些背包支持无条件换货？"), extract("哪些背包不支持无条件换货？")) == "negation"
    assert refusal(extract("Why won't the blender start?"), extract("Why doesn't the blender start?")) is None


def test_one_as_a_pronoun_and_a_closing_bu_are_not_figures_or_negations():
    assert extract("How should one season a wok?").numbers == ()
    assert extract("Is one wok enough?").numbers == (1.0,)
    assert extract("周末能加班不？").negations == 0
    assert extract("周末不能加班吗？").negations == 1

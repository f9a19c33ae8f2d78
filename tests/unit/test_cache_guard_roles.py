"""The guards for exchanged roles around direction markers, for times, and for the asking sentence
(words here are new: none comes from the bench's pair files)."""

from llmesh.cache.guards import extract, refusal
from llmesh.cache.roles import arguments, ask, swapped_roles, times


def _refused(a: str, b: str) -> str | None:
    return refusal(extract(a), extract(b))


def test_arguments_are_the_first_content_word_after_each_marker():
    fn = frozenset({"the", "my", "a"})
    got = arguments("ship the crate from Oslo to my cabin", "ship the crate from oslo to my cabin", fn, str)
    assert got == {("from", "oslo"), ("to", "cabin")}
    assert arguments("把YAML转成TOML", "把yaml转成toml", fn, str) == {("把", "yaml"), ("成", "toml")}
    assert ("比", "猫") in arguments("狗比猫重吗", "狗比猫重吗", fn, str)


def test_exchanged_roles_are_refused_and_kept_roles_pass():
    assert _refused("How do I carry a kayak from the lake to the barn?",
                    "How do I carry a kayak from the barn to the lake?") == "direction"
    assert _refused("Translate Welsh into Basque", "Translate Basque into Welsh") == "direction"
    assert _refused("Is a walrus heavier than a moose?", "Is a moose heavier than a walrus?") == "direction"
    assert _refused("怎么把毛笔字转成楷体？", "怎么把楷体转成毛笔字？") == "direction"
    assert _refused("松鼠给刺猬送信", "刺猬给松鼠送信") == "direction"
    # a reordered sentence keeps each marker's argument
    assert _refused("How do I carry a kayak from the lake to the barn?",
                    "From the lake to the barn, how do I carry a kayak?") is None


def test_a_synonym_argument_is_not_an_exchange():
    a = frozenset({("to", "barn")})
    b = frozenset({("to", "shed")})
    assert not swapped_roles(a, frozenset({"kayak", "barn"}), b, frozenset({"kayak", "shed"}))
    assert swapped_roles(frozenset({("to", "barn"), ("from", "lake")}), frozenset({"lake", "barn"}),
                         frozenset({("to", "lake"), ("from", "barn")}), frozenset({"lake", "barn"}))


def test_times_name_classes():
    assert times("is the pier open tomorrow", "is the pier open tomorrow") == {"d+1"}
    assert times("x", "rent due next quarter and last week") == {"quarter+1", "week-1"}
    assert times("x", "ferry on thursday in october") == {"thu", "oct"}
    assert times("明年的灯会", "明年的灯会") == {"y+1"}
    assert times("周三傍晚", "周三傍晚") == {"wd三", "evening"}
    assert times("x", "how do i bake bread") == frozenset()


def test_different_times_are_refused():
    assert _refused("Is the pier open tomorrow?", "Is the pier open yesterday?") == "time"
    assert _refused("When is rent due this quarter?", "When is rent due next quarter?") == "time"
    assert _refused("Does the ferry run on Thursday?", "Does the ferry run on Friday?") == "time"
    assert _refused("去年的灯会在哪办？", "明年的灯会在哪办？") == "time"
    assert _refused("上午的讲座几点开始？", "下午的讲座几点开始？") == "time"
    assert _refused("Is the pier open tomorrow?", "Will the pier be open tomorrow?") is None


def test_the_asking_sentence_leaves_out_context_and_greetings():
    assert ask("Good evening. My kettle hums. How do I descale a kettle? Cheers!") == "How do I descale a kettle?"
    assert ask("Reset a kettle") == "Reset a kettle"
    assert ask("晚上好！我家水壶坏了。水壶怎么除垢？谢谢") == "水壶怎么除垢？"
    # a time or side named in the context, not in the question, is not refused
    assert _refused("How do I descale a kettle?",
                    "hi, I spent the weekend cleaning. How do I descale a kettle?") is None


def test_context_only_one_side_adds_is_left_out_of_the_guards():
    short = "How do I oil a bicycle chain?"
    chatty = "Ugh, it is 3am and my Raleigh squeaks all week. How do I oil a bicycle chain? Thanks!"
    assert extract(chatty).whole is not None and extract(short).whole is None
    assert _refused(short, chatty) is None
    # both with context: compared whole, so the contexts' figures count
    assert _refused("My bike is from 2019. How do I oil a bicycle chain?",
                    "My bike is from 2021. How do I oil a bicycle chain?") == "number"
    # a word the context swaps in the question still counts for the content guard
    assert _refused("How do I oil a bicycle chain?", "It squeaks. How do I oil a scooter chain?") == "content"


def test_everyone_and_anyone_are_scope_words():
    assert _refused("How do I reset my locker code?", "How do I reset the locker codes for everyone here?") == "scope"
    assert extract("does anyone sell kites").scope == {"any"}


def test_the_ask_starts_after_its_lead_in():
    assert ask("你好，我昨天刚搬家，请问燃气怎么开通？") == "燃气怎么开通？"
    assert ask("Long story, short version: how do I patch a tent?") == "how do I patch a tent?"
    assert ask("How do I use std::map in C++?") == "How do I use std::map in C++?"
    assert ask("请问？") == "请问？"  # nothing after the lead-in: the sentence stays
    assert _refused("燃气怎么开通？", "你好，我昨天刚搬家，请问燃气怎么开通？") is None

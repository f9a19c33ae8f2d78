from llmesh.engine.stops import StopMatcher


def feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out if matcher.stopped else out + matcher.flush()


def test_no_stops_passes_text_through():
    m = StopMatcher(())
    assert m.feed("hello") == "hello"
    assert not m.stopped


def test_stop_inside_one_piece_cuts_before_it():
    m = StopMatcher(("END",))
    assert feed_all(m, ["abc END def"]) == "abc "
    assert m.stopped


def test_stop_split_across_pieces_is_never_emitted():
    m = StopMatcher(("\n\nUser:",))
    emitted = []
    for piece in ["Hi", " there", "\n", "\nUs", "er:", " more"]:
        emitted.append(m.feed(piece))
        if m.stopped:
            break
    assert "".join(emitted) == "Hi there"
    assert m.stopped


def test_partial_match_that_fails_is_released():
    m = StopMatcher(("STOP",))
    assert m.feed("ab ST") == "ab "
    assert m.feed("ART") == "START"
    assert not m.stopped


def test_earliest_of_several_stops_wins():
    m = StopMatcher(("two", "one"))
    assert m.feed("zero one two") == "zero "


def test_flush_returns_held_tail_at_end():
    m = StopMatcher(("xyz",))
    assert m.feed("abcxy") == "abc"
    assert m.flush() == "xy"

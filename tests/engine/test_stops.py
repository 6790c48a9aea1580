from __future__ import annotations

from app.engine.stops import StopMatcher


def feed_all(matcher, deltas):
    return [matcher.feed(d) for d in deltas]


def test_no_stop_strings_pass_everything_through():
    assert feed_all(StopMatcher(), ["a", "b"]) == ["a", "b"]


def test_text_that_may_become_a_stop_is_held_back():
    m = StopMatcher(("STOP",))
    assert feed_all(m, ["hello S", "T", "O"]) == ["hello ", "", ""]
    assert m.feed("P and more") == ""
    assert m.stopped


def test_a_false_alarm_is_released():
    m = StopMatcher(("STOP",))
    assert feed_all(m, ["ST", "ART"]) == ["", "START"]
    assert m.feed("S") == "" and m.flush() == "S"


def test_stop_inside_one_delta_and_earliest_of_several():
    m = StopMatcher(("\n\n", "END"))
    assert m.feed("one END two\n\n") == "one "
    assert m.stopped and m.feed("x") == "" and m.flush() == ""

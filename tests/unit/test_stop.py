"""StopMatcher: first match in growing text (strings and regexes), holdback, start offsets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weft.runtime.stop import StopMatcher


def feed(matcher, text, cuts, start=0):
    """Search each prefix text[:cut] in turn, as a scheduler does; the first match and its cut."""
    for cut in [*sorted(cuts), len(text)]:
        found = matcher.search(text[:cut], start)
        if found is not None:
            return found, cut
    return None, len(text)


def brute_force(stops, text, start):
    """The match that ends first, then the longer one; none before `start`."""
    matches = [
        (q + len(s), q, s)
        for s in stops
        for q in range(start, len(text) - len(s) + 1)
        if text.startswith(s, q)
    ]
    return (min(matches)[1], min(matches)[2]) if matches else None


@pytest.mark.parametrize(
    "stops, text, expected",
    [
        (["world"], "Hello world!", (6, "world")),
        (["o", "world"], "Hello world", (4, "o")),  # earliest wins
        (["world", "wor"], "Hello world", (6, "wor")),  # "wor" is out before "world" ends
        (["lo w", "o"], "Hello world", (4, "o")),  # same: "o" ends at 5, "lo w" at 7
        (["ab", "b"], "xab", (1, "ab")),  # same end: the longer one
        (["é", "😀"], "caf😀 é", (3, "😀")),  # offsets are str (code point) offsets
        (["\n\n"], "a\nb\n\nc", (3, "\n\n")),
        (["zz"], "Hello", None),
    ],
)
def test_one_shot(stops, text, expected):
    assert StopMatcher(stops).search(text) == expected


def test_stop_string_spanning_several_steps():
    m = StopMatcher(["<|im_end|>"])
    assert m.search("Hi <|im") is None and m.search("Hi <|im_e") is None
    assert m.search("Hi <|im_end|>") == (3, "<|im_end|>")
    assert m.search("Hi <|im_end|>") == (3, "<|im_end|>")  # repeated: reported again


def test_stop_inside_one_token_with_text_after():
    m = StopMatcher(["END"])
    assert m.search("The ") is None
    text = "The ENDING"  # one step added "ENDING": the caller trims text[offset:]
    offset, matched = m.search(text)
    assert text[:offset] == "The " and matched == "END"


def test_start_excludes_earlier_matches():
    m = StopMatcher(["a"])
    assert m.search("aaa", start=3) is None
    assert m.search("aaab", start=3) is None
    assert m.search("aaaba", start=3) == (4, "a")
    assert StopMatcher(["aa"]).search("aaa", start=1) == (1, "aa")
    assert StopMatcher(["x"]).search("ab", start=10) is None


def test_only_unchecked_text_is_searched():
    """A match must end in new text: checked text with no match is not searched again."""
    m = StopMatcher(["a"])
    assert m.search("xa", start=2) is None
    assert m.search("xab", start=0) is None  # `start` must not decrease: "a" was checked
    assert m.search("xaba", start=0) == (3, "a")


@settings(max_examples=500, deadline=None)
@given(
    stops=st.lists(st.text("ab", min_size=1, max_size=4), min_size=1, max_size=3),
    text=st.text("ab", max_size=20),
    cuts=st.lists(st.integers(0, 20), max_size=8),
    start=st.integers(0, 6),
)
def test_streaming_equals_one_shot(stops, text, cuts, start):
    """However the text is cut into steps, the first match is the brute-force one."""
    found, cut = feed(StopMatcher(stops), text, cuts, start)
    assert found == brute_force(stops, text, start)
    if found is not None:  # and not earlier: no match in the step before
        assert brute_force(stops, text[: max(c for c in [0, *cuts] if c < cut)], start) is None
        assert found[0] >= start


@settings(max_examples=500, deadline=None)
@given(stops=st.lists(st.text("ab", min_size=1, max_size=5), max_size=3), text=st.text("ab"))
def test_holdback_is_longest_proper_prefix_suffix(stops, text):
    expected = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    assert StopMatcher(stops).holdback(text) == expected


@pytest.mark.parametrize(
    "stops, text, held",
    [
        (["world"], "Hello wor", 3),
        (["world"], "Hello world", 0),  # complete: search reports it, nothing to hold
        (["world"], "Hello", 0),
        (["ab", "aab"], "xaa", 2),
        (["<|im_end|>"], "Hi <", 1),
        (["😀!"], "ok 😀", 1),
    ],
)
def test_holdback(stops, text, held):
    assert StopMatcher(stops).holdback(text) == held


def test_regex():
    m = StopMatcher(stop_regex=[r"\d{3}"])
    assert m.search("call 12") is None
    assert m.search("call 123") == (5, r"\d{3}")  # a regex reports its pattern
    assert m.holdback("call 12") == 0
    assert StopMatcher(stop_regex=[r"\d+"]).search("a 1 22", start=3) == (4, r"\d+")
    assert StopMatcher(stop_regex=["b(?=c)"]).search("abc") == (1, "b(?=c)")


def test_regex_and_string_together():
    m = StopMatcher(["STOP"], [r"[.!?]\s"])
    assert m.search("Yes! STOP") == (3, r"[.!?]\s")
    assert m.search("Yes STOP. ") == (4, "STOP")


@pytest.mark.parametrize(
    "stop, stop_regex, active",
    [((), (), False), (["x"], (), True), ((), ["x"], True)],
)
def test_active(stop, stop_regex, active):
    assert StopMatcher(stop, stop_regex).active is active


@pytest.mark.parametrize(
    "stop, stop_regex",
    [([""], ()), ((), ["("]), ((), ["a*"]), ((), [""])],
)
def test_bad_input_is_rejected(stop, stop_regex):
    with pytest.raises(ValueError):
        StopMatcher(stop, stop_regex)


def test_a_catastrophic_stop_regex_ends_in_a_timeout() -> None:
    """The search gives up under the matcher's time limit and says why. (How long it takes:
    `python benchmarks/host.py stop-regex`.)"""
    from weft.runtime.stop import StopRegexTimeout

    matcher = StopMatcher(stop_regex=["(a|aa)+b"])  # exponential backtracking on "aaa...a"
    with pytest.raises(StopRegexTimeout, match="catastrophic backtracking"):
        matcher.search("a" * 60)

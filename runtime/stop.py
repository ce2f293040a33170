"""Stop strings and stop regexes: the first match in growing text, and how much to hold back."""

from __future__ import annotations

from collections.abc import Sequence

import regex

# A stop regex runs in the scheduler loop after every step of its request: a pattern that
# backtracks catastrophically must cost one bounded search, not stall every other request.
STOP_REGEX_TIMEOUT_S = 0.05


class StopRegexTimeout(ValueError):
    """A stop regex search ran past STOP_REGEX_TIMEOUT_S (the request is aborted with this)."""


class StopMatcher:
    """Finds the first stop string or stop regex match in a request's growing output text.

    One matcher per request; `search` is called with the whole text so far after each step, with
    a text that only grows and a `start` that never decreases.

    Which match wins: the one that *ends* first, and at equal ends the longer one (the earlier
    start). That is the match a character-by-character stream sees first, so the result does not
    depend on how the text was split into steps (stops "bcd" and "abcdef" in "abcdef" give "bcd").
    Where no match contains another this is simply the earliest match.

    Regexes: a search from `start` over the whole text on every call (a regex has no length
    bound, so this is O(text)), with the `regex` module's timeout (StopRegexTimeout); its
    leftmost match takes part in the rule above. A regex may match
    text that a later step would extend ("\\d+" reports "12" before "3" arrives), and `holdback`
    cannot know how much of a stream a regex may still match, so it returns 0 for regexes.
    """

    def __init__(self, stop: Sequence[str] = (), stop_regex: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stop))
        self._regexes = tuple(_compile(p) for p in dict.fromkeys(stop_regex))
        self._checked = 0  # text[:_checked] was searched and held no match

    ##### Public API #####

    @property
    def active(self) -> bool:
        """Whether there is any stop string or regex."""
        return bool(self._stops or self._regexes)

    def search(self, text: str, start: int = 0) -> tuple[int, str] | None:
        """The first match at or after `start` that ends in text not checked before.

        Returns (offset of the match start, what matched): the stop string itself, or the regex
        pattern (as SGLang reports it in finish_reason.matched). A stop string costs O(new text + its length); a found match is reported
        again by a repeated call, since only text without a match counts as checked.
        """
        best: tuple[int, int, str] | None = None  # (end, offset, matched)
        for s in self._stops:
            offset = text.find(s, max(start, self._checked - len(s) + 1))
            if offset >= 0:
                best = _earlier(best, (offset + len(s), offset, s))
        for pattern in self._regexes:
            try:
                m = pattern.search(text, start, timeout=STOP_REGEX_TIMEOUT_S)
            except TimeoutError:
                raise StopRegexTimeout(
                    f"stop_regex {pattern.pattern!r} took over {STOP_REGEX_TIMEOUT_S * 1e3:.0f} ms "
                    f"on {len(text)} characters of output (catastrophic backtracking?)"
                ) from None
            if m is not None:
                best = _earlier(best, (m.end(), m.start(), pattern.pattern))
        if best is None:
            self._checked = max(self._checked, len(text))
            return None
        return best[1], best[2]

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string.

        A stream withholds these chars until the next step resolves them. Always 0 for regexes.
        """
        held = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held


##### Internal Helper Functions #####


def _earlier(a: tuple[int, int, str] | None, b: tuple[int, int, str]) -> tuple[int, int, str]:
    """The match that ends first; at equal ends the one that starts first (the longer)."""
    return b if a is None or b[:2] < a[:2] else a


def _compile(pattern: str) -> regex.Pattern[str]:
    """Compiled with `regex` (re's syntax, VERSION0) for its search timeout."""
    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        raise ValueError(f"invalid stop_regex {pattern!r}: {e}") from e
    if compiled.match("", timeout=STOP_REGEX_TIMEOUT_S) is not None:
        raise ValueError(f"stop_regex {pattern!r} matches the empty string")
    return compiled

"""Checks of user text at the boundary: lone UTF-16 surrogates (not Unicode text: no tokenizer
takes them and UTF-8 cannot encode them), found before the text reaches a tokenizer or a socket."""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text`, or None when it is valid Unicode.

    JSON can spell one (an unpaired "\\ud800" escape) and json.loads keeps it; a surrogate pair
    written as two escapes is joined into one character, so any surrogate left is a lone one."""
    if text.isascii():
        return None
    found = _SURROGATE.search(text)
    return None if found is None else found.start()


def check_text(text: str, name: str) -> str:
    """`text` itself, or ValueError naming `name` and the offending character."""
    at = lone_surrogate(text)
    if at is not None:
        raise ValueError(surrogate_message(name, text, at))
    return text


def surrogate_message(name: str, text: str, at: int) -> str:
    return (
        f"{name} contains a lone UTF-16 surrogate ({ascii(text[at])} at character {at}), which "
        "is not valid Unicode text: send UTF-8 text (a JSON escape must pair a high surrogate "
        "with a low one)"
    )

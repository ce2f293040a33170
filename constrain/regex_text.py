"""Regex and Lark text, read without compiling: counted repetitions and the expanded size (for the
grammar limits), and the classes `\\d` `\\w` `\\s` (and `\\D` `\\W` `\\S`) rewritten to their ASCII
meaning, as Python's `re.ASCII`, xgrammar and SGLang read them.

The dialect is Rust's regex-syntax (llguidance and outlines-core both parse with it). A pattern
the scan does not understand is left to the backend, which refuses it with its own message.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")
_LARK_REPEAT = re.compile(r"~\s*(\d+)(\s*\.\.\s*(\d+))?")
_SHORTHAND = re.compile(r"\\[dDwWsS]")
# a quote or a backslash in a class: itself, escaped, or as a hex / Unicode escape
_QUOTE_OR_BACKSLASH = re.compile(r'"|\\\\|\\(?:x|u00|[xu]\{0*)(?:22|5[cC])')
# NOTE: the members of Python's ASCII `\d` `\w` `\s`, as the body of a Rust regex class; `\s` is
# spelled in hex escapes so that a verbose-mode `(?x)` pattern cannot drop its space.
ASCII_CLASSES = {
    "d": "0-9",
    "w": "A-Za-z0-9_",
    "s": "\\x09-\\x0D\\x20",
}
ASCII_CLASSES.update({k.upper(): v for k, v in ASCII_CLASSES.items()})


@dataclass(frozen=True)
class RegexSize:
    """What a regex costs a backend: its largest counted repetition bound (`{n}`, `{n,m}`:
    max(n, m)), its items with every counted repetition expanded (`(a{10}){10}` is 100), and
    its deepest group nesting."""

    max_repeat: int
    expanded: int
    depth: int


def regex_size(pattern: str) -> RegexSize:
    """The size of `pattern` (Rust regex syntax), in one pass without recursion."""
    totals, lasts = [0], [0]  # per open group: items so far, items of its last atom
    max_repeat = depth = 0
    for kind, text in _regex_tokens(pattern):
        if kind == "open":
            totals.append(0)
            lasts.append(0)
            depth = max(depth, len(totals) - 1)
        elif kind == "close" and len(totals) > 1:
            inner = totals.pop()
            lasts.pop()
            totals[-1] += inner
            lasts[-1] = inner
        elif kind == "count":
            m = _QUANTIFIER.fullmatch(text)
            assert m is not None
            count = max(int(m.group(1)), int(m.group(3) or 0))
            max_repeat = max(max_repeat, count)
            totals[-1] += lasts[-1] * max(count - 1, 0)
            lasts[-1] *= count
        elif kind == "atom":
            totals[-1] += 1
            lasts[-1] = 1
    return RegexSize(max_repeat, sum(totals), depth)


def ascii_classes(pattern: str) -> str:
    """`pattern` with `\\d` `\\w` `\\s` as Python's ASCII classes (`[0-9]`, `[A-Za-z0-9_]`,
    `[\\t\\n\\v\\f\\r ]`) and `\\D` `\\W` `\\S` as their negations, in character classes too
    (`[\\w-]` is `[A-Za-z0-9_-]`, `[\\S_]` the nested class `[[^...]_]`); everything else as written
    (`\\\\w` is a backslash, then w)."""
    if _SHORTHAND.search(pattern) is None:
        return pattern
    out: list[str] = []
    tokens = list(_regex_tokens(pattern, classes=True))
    for i, (kind, text) in enumerate(tokens):
        body = ASCII_CLASSES.get(text[1:]) if len(text) == 2 and text[0] == "\\" else None
        if body is None:
            out.append(text)
        elif text[1].isupper():
            out.append(f"[^{body}]")
        elif kind == "class_item" and not _starts_range(tokens[i + 1 : i + 3]):
            out.append(body)
        else:  # NOTE: `[\w-z]` is \w, `-`, z: a bare `0-9_` would make `_-z` a range
            out.append(f"[{body}]")
    return "".join(out)


def json_string_classes(pattern: str) -> str:
    """`pattern` for a JSON string's content in llguidance (1.9): a negated class that leaves
    out `"` or `\\` also leaves out U+001F. A class holding every control character (U+0000 to
    U+001F; `\\n` aside) lets the library write any JSON escape, `\\"` and `\\\\` included, so
    `[^"]*` would let a quote through; with one more control left out the class is quoted
    exactly (U+001F, the unit separator, is then the one character such a string loses)."""
    if "[^" not in pattern:
        return pattern
    out = []
    for kind, text in _regex_tokens(pattern):
        if kind == "atom" and text.startswith("[^") and text.endswith("]") and _leaks(text):
            text = f"{text[:-1]}\\x1f]"
        out.append(text)
    return "".join(out)


def _leaks(negated: str) -> bool:
    """Whether the negated class `negated` leaves out `"` or `\\` and holds every control
    character but perhaps `\\n` (read by Python's `re`; one it cannot read: whether it names a
    quote or a backslash)."""
    try:
        with warnings.catch_warnings():  # a nested class (Rust syntax) warns in Python
            warnings.simplefilter("ignore")
            rx = re.compile(negated)
    except re.error:
        return _QUOTE_OR_BACKSLASH.search(negated[2:-1]) is not None
    if rx.fullmatch('"') and rx.fullmatch("\\"):
        return False
    return all(rx.fullmatch(chr(c)) for c in range(0x20) if c != 0x0A)


def lark_regexes(grammar: str) -> Iterator[tuple[int, int]]:
    """(start, end) of the body of each `/regex/` literal of a Lark grammar (strings and `//`
    comments skipped)."""
    i, n, gbnf = 0, len(grammar), "::=" in grammar
    while i < n:
        ch = grammar[i]
        if ch in "\"'":
            i = _string_end(grammar, i)
        elif (skip := _skipped(grammar, i, gbnf)) > i:
            i = skip
        elif ch == "/":
            end = _regex_end(grammar, i)
            yield i + 1, end
            i = end + 1
        else:
            i += 1


def lark_repeats(grammar: str) -> Iterator[int]:
    """The bounds of a Lark grammar's counted repetitions outside its literals: `x{n}`, `x{n,m}`,
    `x ~ n`, `x ~ n..m` (each n and m)."""
    i, n, gbnf = 0, len(grammar), "::=" in grammar
    while i < n:
        ch = grammar[i]
        if ch in "\"'":
            i = _string_end(grammar, i)
            continue
        if (skip := _skipped(grammar, i, gbnf)) > i:
            i = skip
            continue
        if ch == "/":
            i = _regex_end(grammar, i) + 1
            continue
        m = (_QUANTIFIER if ch == "{" else _LARK_REPEAT).match(grammar, i) if ch in "{~" else None
        if m is not None:
            yield int(m.group(1))
            if m.group(3):
                yield int(m.group(3))
            i = m.end()
            continue
        i += 1


def lark_ascii_classes(grammar: str) -> str:
    """A Lark grammar with `ascii_classes` applied to each `/regex/` literal."""
    if _SHORTHAND.search(grammar) is None:
        return grammar
    out, at = [], 0
    for start, end in lark_regexes(grammar):
        out += [grammar[at:start], ascii_classes(grammar[start:end])]
        at = end
    out.append(grammar[at:])
    return "".join(out)


##### Internal Helper Functions #####


def _regex_tokens(pattern: str, classes: bool = False) -> Iterator[tuple[str, str]]:
    """(kind, text) pieces of a regex: "open", "close", "count" ({n,m}), "op" (* + ? |, flags),
    "atom" (a char, an escape, a whole class); with `classes`, a class comes in pieces:
    "class" (brackets, `^`, `[:name:]`) and "class_item" (a char or an escape in it)."""
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            end = _escape_end(pattern, i)
            yield "atom", pattern[i:end]
            i = end
        elif ch == "[":
            end = _class_end(pattern, i)
            if classes:
                yield from _class_tokens(pattern[i:end])
            else:
                yield "atom", pattern[i:end]
            i = end
        elif ch == "(":
            end = i + 1
            if pattern.startswith("?", end):  # (?:, (?P<name>, (?i), (?i:
                close = re.compile(r"\?[^):]*[):]").match(pattern, end)
                end = close.end() if close is not None else end
                if pattern[end - 1] == ")":  # a flag group such as (?i): no group opens
                    yield "op", pattern[i:end]
                    i = end
                    continue
            yield "open", pattern[i:end]
            i = end
        elif ch == ")":
            yield "close", ch
            i += 1
        elif ch == "{" and (m := _QUANTIFIER.match(pattern, i)) is not None:
            yield "count", m.group()
            i = m.end()
        elif ch in "*+?|^$":
            yield "op", ch
            i += 1
        else:
            yield "atom", ch
            i += 1


def _class_tokens(text: str) -> Iterator[tuple[str, str]]:
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            end = _escape_end(text, i)
            yield "class_item", text[i:end]
            i = end
        elif text.startswith("[:", i) and (end := text.find(":]", i + 2)) >= 0:
            yield "class", text[i : end + 2]
            i = end + 2
        else:
            yield ("class" if ch in "[]^" else "class_item"), ch
            i += 1


def _starts_range(tokens: list[tuple[str, str]]) -> bool:
    """Whether these class pieces, after a class item, make it a range's start (`-` then a char)."""
    return len(tokens) == 2 and tokens[0] == ("class_item", "-") and tokens[1][0] == "class_item"


def _escape_end(pattern: str, i: int) -> int:
    """End of the escape at `i` (`\\x`, `\\p{..}`, `\\x{..}`, `\\u{..}`)."""
    if i + 1 >= len(pattern):
        return len(pattern)
    if pattern[i + 1] in "pPxuU" and pattern.startswith("{", i + 2):
        close = pattern.find("}", i + 3)
        return len(pattern) if close < 0 else close + 1
    return i + 2


def _class_end(pattern: str, i: int) -> int:
    """End of the (possibly nested) class starting at `i`; the end of the text if unclosed."""
    depth, j, n = 0, i, len(pattern)
    while j < n:
        ch = pattern[j]
        if ch == "\\":
            j = _escape_end(pattern, j)
            continue
        if ch == "[":
            if pattern.startswith("[:", j) and (end := pattern.find(":]", j + 2)) >= 0:
                j = end + 2
                continue
            depth += 1
            j += 1
            j += pattern.startswith("^", j)
            j += pattern.startswith("]", j)  # a `]` first in a class is a literal
            continue
        if ch == "]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return n


def _skipped(grammar: str, i: int, gbnf: bool) -> int:
    """Past a comment (`//`; GBNF's `#`) or a GBNF character class at `i`; else `i`. (GBNF, which
    llguidance converts to Lark, is told apart by its `::=`.)"""
    if grammar.startswith("//", i) or (gbnf and grammar.startswith("#", i)):
        end = grammar.find("\n", i)
        return len(grammar) if end < 0 else end
    if gbnf and grammar.startswith("[", i):
        return _class_end(grammar, i)
    return i


def _string_end(text: str, i: int) -> int:
    quote, j, n = text[i], i + 1, len(text)
    while j < n and text[j] != quote:
        j += 2 if text[j] == "\\" else 1
    return min(j + 1, n)


def _regex_end(text: str, i: int) -> int:
    """Index of the `/` closing the Lark regex literal opened at `i` (or the text's end)."""
    j, n = i + 1, len(text)
    while j < n and text[j] != "/" and text[j] != "\n":
        j += 2 if text[j] == "\\" else 1
    return min(j, n)

"""JSON strings for outlines-core: a regex over a string's characters (a schema's `pattern`, a
weft `format`, a length bound) rewritten as a regex over the JSON text that spells the string.

outlines-core pastes a string schema's `pattern` between the quotes of its JSON string, so a
pattern there must describe the escaped text, not the string. Each character is spelled as
`json.dumps(..., ensure_ascii=False)` spells it: raw, except `"` and `\\` (escaped) and the
control characters U+0000-U+001F (`\\b` `\\f` `\\n` `\\r` `\\t`, else `\\u00XX` in either case);
`/` may also be `\\/`. Other `\\u` escapes are not written (as with llguidance).

Patterns are read as Python's `re` reads them (jsonschema validates with it), `\\d` `\\w` `\\s` as
ASCII classes (as regex_text.ascii_classes has llguidance read them), `.` as any character but a
newline, `$` as the end of the string. What cannot be rewritten exactly raises PatternError:
lookarounds, backreferences, word boundaries, inline flags, anchors inside groups, syntax Python
does not read (`\\p{L}`).
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any

from weft.constrain.formats import format_pattern

# NOTE: Python's own regex parser (re._parser; sre_parse before 3.11): the AST that `re` compiles.
_sre: Any = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")

MAX_CODE = 0x10FFFF
Ranges = list[tuple[int, int]]  # sorted, disjoint, inclusive code point ranges
ALL: Ranges = [(0, MAX_CODE)]
_SURROGATES: Ranges = [(0xD800, 0xDFFF)]
_SHORT = {0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r"}
_ASCII_CATEGORIES: dict[str, Ranges] = {
    "DIGIT": [(0x30, 0x39)],
    "WORD": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    "SPACE": [(0x09, 0x0D), (0x20, 0x20)],
}
_META = set("\\.+*?()|[]{}^$#&-~ ")  # written as escapes (Rust's regex::escape, and space)
_FLAGS = re.IGNORECASE | re.MULTILINE | re.DOTALL  # inline flags that change what matches


class PatternError(ValueError):
    """A regex that cannot be rewritten exactly (the message says why); `readable`: whether
    Python's `re` (and so the output validation) reads it."""

    def __init__(self, message: str, readable: bool = True) -> None:
        super().__init__(message)
        self.readable = readable


##### Public API #####


def pattern_body(pattern: str) -> str:
    """The JSON text (between the quotes) of the strings in which `pattern` finds a match:
    JSON Schema's `pattern` searches, as `re.search` does, unless anchored by `^` / `$`."""
    try:
        parsed = _sre.parse(pattern)
    except (re.error, OverflowError, RecursionError) as e:
        raise PatternError(f"Python's re cannot read it ({e})", readable=False) from None
    if parsed.state.flags & _FLAGS:
        raise PatternError("inline flags are not supported")
    items = list(parsed)
    if len(items) == 1 and _name(items[0][0]) == "BRANCH":
        branches = [list(b) for b in items[0][1][1]]
    else:
        branches = [items]
    any_text = f"(?:{char_class(ALL)})*"
    out = []
    for seq in branches:
        head = not (seq and _is_at(seq[0], "AT_BEGINNING", "AT_BEGINNING_STRING"))
        seq = seq if head else seq[1:]
        tail = not (seq and _is_at(seq[-1], "AT_END", "AT_END_STRING"))
        seq = seq if tail else seq[:-1]
        out.append(any_text * head + _sequence(seq) + any_text * tail)
    return "(?:" + "|".join(out) + ")"


def length_body(min_length: int, max_length: int | None) -> str:
    """The JSON text of the strings of `min_length` to `max_length` characters (None: no bound)."""
    upper = "" if max_length is None else str(max_length)
    return f"(?:{char_class(ALL)}){{{min_length},{upper}}}"


def format_body(name: str) -> str | None:
    """The JSON text of the strings of weft's format `name` (formats.py); None if not one."""
    pattern = format_pattern(name)
    return None if pattern is None else pattern_body(pattern)


def char_class(ranges: Ranges) -> str:
    """A regex of the spellings of one character of `ranges` (see the module doc)."""
    parts = []
    raw = _minus(ranges, [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C), *_SURROGATES])
    if len(raw) == 1 and raw[0][0] == raw[0][1]:
        char = chr(raw[0][0])
        parts.append(char if char.isprintable() and char not in _META else _literal(raw[0][0]))
    elif raw:
        parts.append("[" + "".join(_class_item(a, b) for a, b in raw) + "]")
    if _contains(ranges, 0x22):
        parts.append('\\\\"')
    if _contains(ranges, 0x5C):
        parts.append("\\\\\\\\")
    if _contains(ranges, 0x2F):
        parts.append("\\\\/")
    controls = [c for c in range(0x20) if _contains(ranges, c)]
    if len(controls) == 0x20:
        parts.append("\\\\(?:[bfnrt]|u00[01][0-9a-fA-F])")
    for c in [] if len(controls) == 0x20 else controls:
        short = _SHORT.get(c)
        parts.append("\\\\" + (short if short else "u00" + "".join(map(_hex_digit, f"{c:02x}"))))
    if not parts:
        raise PatternError("a character class that no character matches")
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


##### Internal Helper Functions #####


def _name(op: Any) -> str:
    return str(op)


def _is_at(item: tuple[Any, Any], *names: str) -> bool:
    return _name(item[0]) == "AT" and _name(item[1]) in names


def _sequence(items: list[tuple[Any, Any]]) -> str:
    return "".join(_item(op, av) for op, av in items)


def _item(op: Any, av: Any) -> str:
    name = _name(op)
    if name == "LITERAL":
        return char_class([(av, av)])
    if name == "NOT_LITERAL":
        return char_class(_complement([(av, av)]))
    if name == "ANY":
        return char_class(_complement([(0x0A, 0x0A)]))
    if name == "IN":
        return char_class(_class_ranges(av))
    if name == "BRANCH":
        return "(?:" + "|".join(_sequence(list(b)) for b in av[1]) + ")"
    if name == "SUBPATTERN":
        _, add_flags, del_flags, sub = av
        if (add_flags | del_flags) & _FLAGS:
            raise PatternError("inline flags are not supported")
        return "(?:" + _sequence(list(sub)) + ")"
    if name in ("MAX_REPEAT", "MIN_REPEAT"):
        low, high, sub = av
        upper = "" if high == _sre.MAXREPEAT else str(high)
        return "(?:" + _sequence(list(sub)) + f"){{{low},{upper}}}"
    if name == "AT":
        raise PatternError("anchors are supported only at the start and end of the pattern")
    what = {
        "ASSERT": "lookarounds",
        "ASSERT_NOT": "lookarounds",
        "GROUPREF": "backreferences",
        "GROUPREF_EXISTS": "conditional groups",
        "POSSESSIVE_REPEAT": "possessive repetitions",
        "ATOMIC_GROUP": "atomic groups",
    }.get(name, name.lower())
    raise PatternError(f"{what} are not supported")


def _class_ranges(items: list[tuple[Any, Any]]) -> Ranges:
    negate = bool(items) and _name(items[0][0]) == "NEGATE"
    ranges: Ranges = []
    for op, av in items[1:] if negate else items:
        name = _name(op)
        if name == "LITERAL":
            ranges.append((av, av))
        elif name == "RANGE":
            ranges.append((av[0], av[1]))
        elif name == "CATEGORY":
            kind = _name(av).removeprefix("CATEGORY_")
            base = _ASCII_CATEGORIES.get(kind.removeprefix("NOT_"))
            if base is None:
                raise PatternError(f"the class {kind.lower()} is not supported")
            ranges += _complement(base) if kind.startswith("NOT_") else base
        else:
            raise PatternError(f"{name.lower()} in a character class is not supported")
    merged = _normalized(ranges)
    return _complement(merged) if negate else merged


def _normalized(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for a, b in _normalized(ranges):
        if a > start:
            out.append((start, a - 1))
        start = b + 1
    if start <= MAX_CODE:
        out.append((start, MAX_CODE))
    return out


def _minus(ranges: Ranges, removed: Ranges) -> Ranges:
    keep = _complement(removed)
    out = []
    for a, b in _normalized(ranges):
        for c, d in keep:
            if max(a, c) <= min(b, d):
                out.append((max(a, c), min(b, d)))
    return out


def _contains(ranges: Ranges, code: int) -> bool:
    return any(a <= code <= b for a, b in ranges)


def _literal(code: int) -> str:
    char = chr(code)
    return char if char.isascii() and char.isalnum() else f"\\U{code:08X}"  # Rust and Python


def _class_item(a: int, b: int) -> str:
    return _literal(a) if a == b else f"{_literal(a)}-{_literal(b)}"


def _hex_digit(d: str) -> str:
    return d if d.isdigit() else f"[{d}{d.upper()}]"

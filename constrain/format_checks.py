"""Format checks of the output validation beyond formats.py's regexes: `regex` as ECMA-262 syntax
(the `u` flag's grammar, as JSON Schema reads patterns) and `idn-hostname` under IDNA2008 with the
Bidi rule of RFC 5893 across the whole name.

Python's `re` is the wrong judge of `format: regex`: it accepts Python-only syntax (`(?P<n>...)`,
`(?#...)`, global inline flags, `\\a`) and refuses valid ECMA-262 (`[]`, `[^]`, `\\cA`,
variable-width lookbehind). `ecma262_error` parses the ES2025 `Pattern` grammar with
[+UnicodeMode, +NamedCaptureGroups]: no Annex B leniency, so a lone `{` or `]` and escapes of
ordinary letters are errors, as a `u`-flag RegExp in a browser says. Unicode property escapes
(`\\p{...}`) are checked for their shape (a name, or name=value, of letters, digits and `_`), not
against Unicode's property tables.
"""

from __future__ import annotations

import unicodedata

import idna

_SYNTAX = frozenset("^$\\.*+?()[]{}|")
_CONTROL_ESCAPES = frozenset("fnrtv")
_CLASS_ESCAPES = frozenset("dDsSwW")
_HEX = frozenset("0123456789abcdefABCDEF")
_MODIFIER_FLAGS = frozenset("ims")
# label separators IDNA maps to "." (RFC 3490 section 3.1)
_DOTS = ("\u002e", "\u3002", "\uff0e", "\uff61")


class _Invalid(Exception):
    """A syntax error in the pattern, with what and where."""


##### Public API #####


def ecma262_error(pattern: str) -> str | None:
    """None if `pattern` is a valid ECMA-262 regular expression (u-mode), else what is wrong."""
    try:
        _Parser(pattern).parse()
    except _Invalid as e:
        return str(e)
    return None


def idn_hostname_ok(text: str) -> bool:
    """Whether `text` is an internationalized hostname: IDNA2008 labels (U-labels or A-labels)
    separated by any of IDNA's full stops, none empty (so no trailing dot), and where any label
    holds a right-to-left character, every label meets the Bidi rule."""
    for dot in _DOTS[1:]:
        text = text.replace(dot, ".")
    labels = text.split(".")
    if not text or any(not label for label in labels):
        return False
    try:
        idna.encode(text)
        unicode_labels = [idna.decode(label) if label.isascii() else label for label in labels]
    except (idna.IDNAError, UnicodeError, ValueError):
        return False
    if not any(_rtl(label) for label in unicode_labels):
        return True
    try:
        return all(idna.check_bidi(label, check_ltr=True) for label in unicode_labels)
    except idna.IDNABidiError:
        return False


##### Internal Helper Functions #####


def _rtl(label: str) -> bool:
    return any(unicodedata.bidirectional(ch) in ("R", "AL", "AN") for ch in label)


class _Parser:
    """Recursive descent over ES2025 22.2.1 `Pattern` in u-mode with named groups."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.groups, self.names = _capture_groups(text)

    def parse(self) -> None:
        self.disjunction()
        if self.pos < len(self.text):
            raise self.error(f"unbalanced {self.text[self.pos]!r}")

    # Disjunction :: Alternative ( | Alternative )*; returns the group names it defines. A name
    # may repeat only in different alternatives (ES2025 duplicate named groups).
    def disjunction(self) -> set[str]:
        names = self.alternative()
        while self.peek("|"):
            self.pos += 1
            names |= self.alternative()
        return names

    def alternative(self) -> set[str]:
        names: set[str] = set()
        while self.pos < len(self.text) and self.text[self.pos] not in "|)":
            term = self.term()
            if names & term:
                raise self.error(f"duplicate group name {sorted(names & term)[0]!r}")
            names |= term
        return names

    def term(self) -> set[str]:
        ch = self.text[self.pos]
        if ch in "^$":
            self.pos += 1
            return set()
        if self.text.startswith(("\\b", "\\B"), self.pos):
            self.pos += 2
            return set()
        if self.text.startswith(("(?=", "(?!", "(?<=", "(?<!"), self.pos):
            self.pos += 4 if self.text[self.pos + 2] == "<" else 3
            names = self.disjunction()
            self.expect(")")
            return names  # u-mode: lookarounds take no quantifier
        names = self.atom()
        self.quantifier()
        return names

    def atom(self) -> set[str]:
        ch = self.text[self.pos]
        if ch == "(":
            return self.group()
        if ch == "[":
            self.character_class()
            return set()
        if ch == "\\":
            self.pos += 1
            self.atom_escape()
            return set()
        if ch in _SYNTAX and ch != ".":
            raise self.error(f"{ch!r} has nothing to repeat or must be escaped")
        self.pos += 1
        return set()

    def group(self) -> set[str]:
        self.pos += 1
        name = None
        if self.peek("?"):
            self.pos += 1
            if self.peek(":"):
                self.pos += 1
            elif self.peek("<"):
                self.pos += 1
                name = self.group_name()
            else:
                self.modifiers()
        names = self.disjunction()
        self.expect(")")
        if name is not None:
            if name in names:
                raise self.error(f"duplicate group name {name!r}")
            names.add(name)
        return names

    def modifiers(self) -> None:
        """(?ims-ims: ...), ES2025's pattern modifiers; a global `(?i)` is not ECMA-262."""
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ":)":
            self.pos += 1
        spec = self.text[start : self.pos]
        add, _, remove = spec.partition("-")
        flags = add + remove
        if (
            not self.peek(":")
            or not flags
            or not set(flags) <= _MODIFIER_FLAGS
            or len(set(flags)) != len(flags)
        ):
            raise self.error(f"(?{spec}...) is not an ECMA-262 group")
        self.pos += 1

    def group_name(self) -> str:
        end = self.text.find(">", self.pos)
        name = self.text[self.pos : end] if end >= 0 else ""
        if not name.replace("$", "_").isidentifier():
            raise self.error(f"bad group name {name!r}")
        self.pos = end + 1
        return name

    def quantifier(self) -> None:
        if self.pos >= len(self.text):
            return
        ch = self.text[self.pos]
        if ch in "*+?":
            self.pos += 1
        elif ch == "{":
            self.pos += 1
            low = self.digits()
            high = low
            if low is None:
                raise self.error("a lone '{' must be escaped")
            if self.peek(","):
                self.pos += 1
                high = self.digits()
            self.expect("}")
            if high is not None and high < low:
                raise self.error("numbers out of order in {} quantifier")
        else:
            return
        if self.peek("?"):
            self.pos += 1  # lazy; a quantifier after this one is an atom error: nothing to repeat

    def atom_escape(self) -> None:
        ch = self.char("an escape")
        if ch in "123456789":
            self.pos -= 1
            number = self.digits() or 0
            if number > self.groups:
                raise self.error(f"\\{number} refers to no group")
        elif ch == "k":
            self.expect("<")
            name = self.group_name()
            if name not in self.names:
                raise self.error(f"\\k<{name}> refers to no group")
        else:
            self.pos -= 1
            self.character_escape()

    def character_class(self) -> None:
        self.pos += 1
        if self.peek("^"):
            self.pos += 1
        while not self.peek("]"):
            low = self.class_atom()
            if self.peek("-") and not self.text.startswith("-]", self.pos):
                self.pos += 1
                high = self.class_atom()
                if low is None or high is None:
                    raise self.error("a class escape cannot bound a range")
                if high < low:
                    raise self.error("range out of order in character class")
        self.pos += 1

    def class_atom(self) -> int | None:
        """One class atom: its code point, or None for a class escape (\\d, \\p{...})."""
        ch = self.char("']' to close the character class")
        if ch != "\\":
            return ord(ch)
        if self.peek("b") or self.peek("-"):
            self.pos += 1
            return 8 if self.text[self.pos - 1] == "b" else ord("-")
        return self.character_escape()

    def character_escape(self) -> int | None:
        """After a backslash: a CharacterClassEscape (None) or a CharacterEscape (its code
        point)."""
        ch = self.char("an escape")
        if ch in _CLASS_ESCAPES:
            return None
        if ch in "pP":
            self.property_escape()
            return None
        if ch in _CONTROL_ESCAPES:
            return ord("\f\n\r\t\v"["fnrtv".index(ch)])
        if ch == "c":
            letter = self.char("a letter after \\c")
            if not (letter.isascii() and letter.isalpha()):
                raise self.error("\\c must be followed by an ASCII letter")
            return ord(letter) % 32
        if ch == "0":
            if self.pos < len(self.text) and self.text[self.pos].isdigit():
                raise self.error("\\0 followed by a digit (an octal escape) is not ECMA-262")
            return 0
        if ch == "x":
            return self.hex_digits(2)
        if ch == "u":
            return self.unicode_escape()
        if ch in _SYNTAX or ch == "/":
            return ord(ch)
        raise self.error(f"\\{ch} is not an ECMA-262 escape")

    def property_escape(self) -> None:
        self.expect("{")
        end = self.text.find("}", self.pos)
        body = self.text[self.pos : end] if end >= 0 else ""
        parts = body.split("=")
        if len(parts) > 2 or not all(p and p.replace("_", "a").isalnum() for p in parts):
            raise self.error(f"bad Unicode property escape {body!r}")
        self.pos = end + 1

    def unicode_escape(self) -> int:
        if self.peek("{"):
            self.pos += 1
            end = self.text.find("}", self.pos)
            digits = self.text[self.pos : end] if end >= 0 else ""
            if not digits or not set(digits) <= _HEX or int(digits, 16) > 0x10FFFF:
                raise self.error("bad \\u{...} escape")
            self.pos = end + 1
            return int(digits, 16)
        return self.hex_digits(4)

    def hex_digits(self, count: int) -> int:
        digits = self.text[self.pos : self.pos + count]
        if len(digits) != count or not set(digits) <= _HEX:
            raise self.error(f"expected {count} hex digits")
        self.pos += count
        return int(digits, 16)

    def digits(self) -> int | None:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in "0123456789":
            self.pos += 1
        return int(self.text[start : self.pos]) if self.pos > start else None

    def char(self, what: str) -> str:
        if self.pos >= len(self.text):
            raise self.error(f"the pattern ends where {what} should be")
        self.pos += 1
        return self.text[self.pos - 1]

    def peek(self, ch: str) -> bool:
        return self.text.startswith(ch, self.pos)

    def expect(self, ch: str) -> None:
        if not self.peek(ch):
            raise self.error(f"expected {ch!r}")
        self.pos += 1

    def error(self, what: str) -> _Invalid:
        return _Invalid(f"{what} at offset {self.pos}")


def _capture_groups(text: str) -> tuple[int, set[str]]:
    """The number of capturing groups and their names (back-references may point forward)."""
    count, names, pos, in_class = 0, set(), 0, False
    while pos < len(text):
        ch = text[pos]
        if ch == "\\":
            pos += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(" and not text.startswith("(?", pos):
            count += 1
        elif text.startswith("(?<", pos) and not text.startswith(("(?<=", "(?<!"), pos):
            count += 1
            end = text.find(">", pos)
            names.add(text[pos + 3 : end] if end >= 0 else "")
        pos += 1
    return count, names

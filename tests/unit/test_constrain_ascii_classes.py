"""`\\d` `\\w` `\\s` (and `\\D` `\\W` `\\S`) read as Python's `re.ASCII` classes in regex specs and in
JSON-schema patterns (regex_text.ascii_classes), and negated classes quoted exactly in a JSON
string (regex_text.json_string_classes): the rewritten text, then random patterns and strings
walked through the llguidance grammar and held to Python's `re` with `re.ASCII`."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_constrain_support import backend, encode, walk

from weft.constrain import GrammarSpec
from weft.constrain.regex_text import ascii_classes, json_string_classes, lark_ascii_classes
from weft.constrain.schema import string_patterns

W, S = "A-Za-z0-9_", "\\x09-\\x0D\\x20"


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (r"\w+", f"[{W}]+"),
        (r"\W", f"[^{W}]"),
        (r"\s*", f"[{S}]*"),
        (r"\S", f"[^{S}]"),
        (r"[\w-]+", f"[{W}-]+"),
        (r"[\w.]", f"[{W}.]"),
        (r"[\w-z]", f"[[{W}]-z]"),  # \w, a literal `-`, z: never the range `_-z`
        (r"[^\s]", f"[^{S}]"),
        (r"[\S_]", f"[[^{S}]_]"),
        (r"[^\W]", f"[^[^{W}]]"),
        (r"\\w\\s", r"\\w\\s"),  # escaped backslashes, then plain letters
        (r"\\\w", f"\\\\[{W}]"),
        (r"\p{L}\w", f"\\p{{L}}[{W}]"),
        (r"[\]\s]", f"[\\]{S}]"),
        (r"a\d\w\s", f"a[0-9][{W}][{S}]"),
        ("plain", "plain"),
    ],
)
def test_ascii_classes_text(pattern: str, expected: str) -> None:
    assert ascii_classes(pattern) == expected


def test_lark_and_schema_patterns() -> None:
    assert lark_ascii_classes('start: "\\\\w" /\\w+\\s/') == f'start: "\\\\w" /[{W}]+[{S}]/'
    schema = {"properties": {"a": {"pattern": r"^\S+$"}}, "patternProperties": {r"^\w$": {}}}
    assert string_patterns(schema) == {
        "properties": {"a": {"pattern": f"^[^{S}]+$"}},
        "patternProperties": {f"^[{W}]$": {}},
    }


# Random patterns from these pieces, and strings from these characters: ASCII word and space
# characters, and the Unicode letters, digits and spaces that the Unicode classes would add.
ATOMS = [r"\d", r"\D", r"\w", r"\W", r"\s", r"\S", "a", "_", "-", " ", r"\\", "."]
ATOMS += [r"[\w-]", r"[^\s]", r"[\S_]", r"[^\W]", r"[\d\s]", r"[^\w\s]", r"\\w", r"[a\W]"]
ATOMS += ['[^"]', r"[^\\]", '[^"\n]', '"']  # classes a JSON string must quote exactly
CHARS = 'aZ9_- \t\n\x0b\x0c\r\\w.é٣\u00a0\u2028\u3000ſK"'

pieces = st.lists(
    st.tuples(st.sampled_from(ATOMS), st.sampled_from(["", "", "*", "+", "?"])),
    min_size=1,
    max_size=4,
)
texts = st.lists(st.text(alphabet=CHARS, max_size=5), min_size=4, max_size=8)


def _pattern(parts: list[tuple[str, str]]) -> str:
    return "".join(atom + op for atom, op in parts)


@settings(max_examples=60, deadline=None)
@given(pieces, texts)
def test_regex_spec_matches_python_ascii(parts: list[tuple[str, str]], texts: list[str]) -> None:
    pattern = _pattern(parts)
    grammar = backend("llguidance").compile(GrammarSpec.regex(pattern))
    for text in texts:
        expected = re.fullmatch(pattern, text, re.ASCII) is not None
        got = walk(grammar.matcher(), encode(text)).accepted
        assert got == expected, (pattern, text, ascii_classes(pattern))


@settings(max_examples=40, deadline=None)
@given(pieces, texts)
def test_schema_pattern_matches_python_ascii(
    parts: list[tuple[str, str]], texts: list[str]
) -> None:
    body = _pattern(parts)
    pattern = "^" + body + "$"  # NOTE: Python's `$` also matches before a final newline: fullmatch
    spec = GrammarSpec.json_schema({"type": "string", "pattern": pattern})
    grammar = backend("llguidance").compile(spec)
    assert not grammar.unenforced
    for text in texts:
        expected = re.fullmatch(body, text, re.ASCII) is not None
        got = walk(grammar.matcher(), encode(json.dumps(text, ensure_ascii=False))).accepted
        assert got == expected, (pattern, text, ascii_classes(pattern))


@pytest.mark.parametrize(
    ("pattern", "text", "matches"),
    [
        (r"\w+", "é", False),
        (r"\w+", "٣", False),
        (r"\W", "é", True),
        (r"\s", "\u00a0", False),
        (r"\s", "\x0b", True),
        (r"\S", "\u2028", True),
        (r"[\w-]+", "a-b_9", True),
        (r"\\w", "\\w", True),
        (r"\\w", "a", False),
    ],
)
def test_ascii_meaning_in_both_paths(pattern: str, text: str, matches: bool) -> None:
    assert (re.fullmatch(pattern, text, re.ASCII) is not None) == matches
    regex = backend("llguidance").compile(GrammarSpec.regex(pattern))
    assert walk(regex.matcher(), encode(text)).accepted == matches
    schema = {"type": "string", "pattern": f"^{pattern}$"}
    grammar = backend("llguidance").compile(GrammarSpec.json_schema(schema))
    got = walk(grammar.matcher(), encode(json.dumps(text, ensure_ascii=False))).accepted
    assert got == matches


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ('^[^"]*$', '^[^"\\x1f]*$'),
        ("[^\\\\]", "[^\\\\\\x1f]"),
        ('[^"\\n]', '[^"\\n\\x1f]'),
        ("[^\\x22a]", "[^\\x22a\\x1f]"),
        ("[^!-#]", "[^!-#\\x1f]"),  # a range over the quote
        ('[^"\\t]', '[^"\\t]'),  # a control left out already: quoted exactly
        ("[^a]", "[^a]"),
        ('["]', '["]'),
        ("plain", "plain"),
    ],
)
def test_json_string_classes(pattern: str, expected: str) -> None:
    assert json_string_classes(pattern) == expected


@pytest.mark.parametrize("pattern", ['^[^"]*$', "^[^\\\\]*$", '^[^"\\n]*$', "^[^!-#]+$"])
def test_negated_classes_never_let_a_quote_or_backslash_through(pattern: str) -> None:
    """llguidance alone writes `\\"` / `\\\\` for these classes (any JSON escape); weft's rewrite
    keeps the value out, at the top level and inside a structural tag's JSON schema."""
    schema = {"type": "string", "pattern": pattern}
    tag = {"type": "structural_tag",
           "format": {"type": "json_schema", "json_schema": schema}}  # fmt: skip
    for spec in (GrammarSpec.json_schema(schema), GrammarSpec.structural_tag(json.dumps(tag))):
        grammar = backend("llguidance").compile(spec)
        for text in ['a"b', "a\\b"]:
            expected = re.fullmatch(pattern, text) is not None
            got = walk(grammar.matcher(), encode(json.dumps(text))).accepted
            assert got == expected, (pattern, text, spec.kind)
        assert walk(grammar.matcher(), encode(json.dumps("ab"))).accepted

"""The outlines backend's schema rewrite (constrain/outlines_schema.py, outlines_containers.py,
outlines_text.py): what it hands outlines-core, what it reports, what it refuses; and, through
the real backend, the cases issue 43 found wrong (`properties` without `type`, keywords next to
a `$ref`, the days of the month)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
from test_constrain_support import backend, encode, walk

from weft.constrain import GrammarError, GrammarSpec
from weft.constrain.formats import FORMAT_REGEXES, INEXACT_FORMATS, conforms
from weft.constrain.outlines_schema import outlines_schema
from weft.constrain.outlines_text import PatternError, format_body, length_body, pattern_body
from weft.constrain.validation import check_output

ALPHABET = [
    "a",
    "b",
    "x",
    "1",
    "@",
    " ",
    "-",
    '"',
    "\\",
    "/",
    "\n",
    "\t",
    "\x01",
    "\x7f",
    "é",
    "😀",
]


def _strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 5))) for _ in range(n)]


def _spellings(s: str) -> set[str]:
    """The JSON texts (between the quotes) that write `s`: json.dumps's, and `\\/` for `/`."""
    text = json.dumps(s, ensure_ascii=False)[1:-1]
    return {text, text.replace("/", "\\/")}


@pytest.mark.parametrize(
    "pattern",
    [r"^a*$", "a+", r'^[^"]+$', r"\d{2}", r"^.$", "x|^y", r"^(ab|c)*$", r"[\s\S]", r"^\w+@\w+$",
     "/", r"^\\$", "", r"^\u0001$", "[^a-z]", r"^[\x00-\x1f]+$", r"^\W?$", r"^a{2,3}?$"],
)  # fmt: skip
def test_pattern_bodies_match_what_re_search_finds(pattern: str) -> None:
    """A pattern searches the string (ASCII classes); its body matches the string's JSON text."""
    body = re.compile(pattern_body(pattern))
    for s in _strings(2000):
        expected = re.search(pattern.replace("$", r"\Z"), s, re.ASCII) is not None
        for text in _spellings(s):
            assert (body.fullmatch(text) is not None) == expected, (pattern, s, text)


def test_patterns_that_cannot_be_rewritten_say_why() -> None:
    for pattern, why in [
        ("(?=a)", "lookarounds"),
        (r"(a)\1", "backreferences"),
        (r"\bfoo", "anchors"),
        ("(?i)a", "inline flags"),
        ("(^a)", "anchors"),
    ]:
        with pytest.raises(PatternError, match=why) as info:
            pattern_body(pattern)
        assert info.value.readable
    with pytest.raises(PatternError) as info:
        pattern_body(r"\p{L}")
    assert not info.value.readable  # nor can the output validation: refused in every mode


def test_lengths_count_characters_not_escapes() -> None:
    body = re.compile(length_body(1, 2))
    for s in ["", "a", '"', "\x01\n", "😀é", "abc", '"""']:
        assert (body.fullmatch(json.dumps(s, ensure_ascii=False)[1:-1]) is not None) == (
            1 <= len(s) <= 2
        ), s


@pytest.mark.parametrize("name", sorted(set(FORMAT_REGEXES) - set(INEXACT_FORMATS)))
def test_format_bodies_match_weft_formats(name: str) -> None:
    samples = {
        "date": ["2024-02-29", "2023-02-29", "2024-04-31", "2024-04-30", "0000-01-01"],
        "date-time": ["2024-02-29T23:59:60Z", "2023-02-29T00:00:00Z", "2024-01-01T00:00:00+01:00"],
        "time": ["23:59:60Z", "12:00:60Z", "00:59:60+01:00", "24:00:00Z", "12:00:00.5z"],
        "duration": ["P1D", "PT1H", "P1Y2M", "P", "PT"],
        "email": ["a@b.c", '"a b"@c.d', "a@[127.0.0.1]", "a@@b", "a"],
        "ipv4": ["127.0.0.1", "256.0.0.1", "01.0.0.1"],
        "ipv6": ["::1", "1::2::3", "::ffff:1.2.3.4"],
        "uri": ["http://a/b?c#d", "a:b", "/relative", "a b:c"],
        "uri-reference": ["/relative", "#frag", "a b"],
        "uuid": ["12345678-1234-1234-1234-123456789abc", "12345678-1234-1234-1234-123456789ab"],
        "json-pointer": ["", "/a~0b/~1/", "/a~2", "a", '/"x"', "/a\\b"],
        "relative-json-pointer": ["0", "12/a", "0#", "01/a", "+1", "1#/a"],
    }[name]
    body = re.compile(format_body(name) or "")
    for s in samples:
        assert (body.fullmatch(json.dumps(s)[1:-1]) is not None) == conforms(name, s), (name, s)


##### The rewrite #####


def rewrite(schema: Any) -> tuple[Any, list[str]]:
    out = outlines_schema(schema)
    return out.schema, list(out.unenforced)


def test_listed_values_meet_every_keyword() -> None:
    """enum / const, booleans, null and close integer bounds are listed: siblings hold exactly."""
    assert rewrite({"enum": [1, "a", 2, 2.0], "type": "integer", "minimum": 2}) == (
        {"anyOf": [{"const": 2}, {"const": 2.0}]},
        [],
    )
    assert rewrite({"type": "integer", "minimum": 1, "maximum": 4, "not": {"const": 3}}) == (
        {"anyOf": [{"const": 1}, {"const": 2}, {"const": 4}]},
        [],
    )
    assert rewrite({"type": ["boolean", "null"], "not": {"const": False}}) == (
        {"anyOf": [{"const": None}, {"const": True}]},
        [],
    )
    assert rewrite({"type": "integer", "minimum": 1}) == ({"type": "integer"}, ["minimum"])


def test_ref_siblings_and_allof_are_merged() -> None:
    schema = {
        "$defs": {"a": {"type": "array", "items": {"type": "boolean"}}},
        "$ref": "#/$defs/a",
        "maxItems": 2,
        "allOf": [{"minItems": 1}],
    }
    booleans = {"anyOf": [{"const": False}, {"const": True}]}
    assert rewrite(schema) == (
        {"type": "array", "items": booleans, "minItems": 1, "maxItems": 2},
        [],
    )


def test_anyof_distributes_its_siblings_and_oneof_is_exact_when_disjoint() -> None:
    string, _ = rewrite({"type": "string", "maxLength": 2})
    assert rewrite({"anyOf": [{"type": "string"}, {"type": "null"}], "maxLength": 2}) == (
        {"anyOf": [string, {"const": None}]},
        [],
    )
    assert rewrite({"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]})[1] == []
    assert rewrite({"oneOf": [{"type": "integer"}, {"type": "number"}]})[1] == ["oneOf"]
    tagged = {
        "oneOf": [
            {"type": "object", "properties": {"k": {"const": n}, "v": {"type": "integer"}},
             "required": ["k"], "additionalProperties": False}
            for n in ("a", "b")
        ]
    }  # fmt: skip
    assert rewrite(tagged)[1] == []
    # a listed value dropped for matching two entries still makes the other entry inexact
    assert rewrite({"oneOf": [{"const": 5}, {"type": "integer"}]}) == (
        {"type": "integer"},
        ["oneOf"],
    )
    assert rewrite({"oneOf": [{"const": 1}, {"const": 2}, {"enum": [2, 3]}]}) == (
        {"anyOf": [{"const": 1}, {"const": 3}]},
        [],
    )


def test_object_counts_and_dependencies_list_the_property_sets() -> None:
    props = {n: {"type": "null"} for n in "abc"}
    base = {"type": "object", "properties": props, "additionalProperties": False}
    two, _ = rewrite({**base, "minProperties": 2, "maxProperties": 2})
    assert sorted(tuple(a["required"]) for a in two["anyOf"]) == [
        ("a", "b"),
        ("a", "c"),
        ("b", "c"),
    ]
    dependent, unenforced = rewrite({**base, "dependentRequired": {"a": ["b"]}})
    assert unenforced == []
    assert [sorted(a["properties"]) for a in dependent["anyOf"]] == [["b", "c"], ["a", "b", "c"]]
    assert dependent["anyOf"][1]["required"] == ["a", "b"]


def test_tuples_are_listed_by_length() -> None:
    schema = {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "null"}}
    with pytest.raises(GrammarError, match="set maxItems"):
        rewrite(schema)
    tuples, _ = rewrite({**schema, "maxItems": 2})
    assert [len(a.get("prefixItems", [])) for a in tuples["anyOf"]] == [0, 1, 2]


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"properties": {"a": {"type": "integer"}}}, "arbitrary JSON array"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}}, "closes objects"),
        ({"type": "object"}, "arbitrary JSON object"),
        ({"type": "array", "items": {}}, "arbitrary JSON array"),
        ({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"},
         "recursive \\$ref"),
        ({"type": "string", "pattern": r"\p{L}"}, "cannot read it"),
        ({"not": {}}, "matches no value"),
    ],
)  # fmt: skip
def test_what_no_regex_follows_is_refused_in_every_mode(schema: Any, words: str) -> None:
    with pytest.raises(GrammarError, match=words):
        rewrite(schema)


##### Through the real backend (outlines-core indexes) #####


def produces(schema: Any, text: str, strict: bool = False) -> bool:
    grammar = backend("outlines", strict).compile(GrammarSpec.json_schema(schema))
    return walk(grammar.matcher(), encode(text)).accepted


def test_properties_without_type_are_refused_and_typed_ones_keep_other_types() -> None:
    """JSON Schema's `properties` constrains objects only: outlines-core made it an object."""
    with pytest.raises(GrammarError, match="arbitrary JSON"):
        backend("outlines").compile(
            GrammarSpec.json_schema({"properties": {"a": {"type": "null"}}})
        )
    schema = {"type": ["object", "null"], "properties": {"a": {"type": "null"}},
              "additionalProperties": False}  # fmt: skip
    for text, ok in [("null", True), ('{"a": null}', True), ("{}", True), ('{"a": 1}', False)]:
        assert produces(schema, text, strict=True) == ok, text


def test_keywords_next_to_a_ref_hold() -> None:
    schema = {"$defs": {"a": {"type": "array", "items": {"type": "integer"}}},
              "$ref": "#/$defs/a", "maxItems": 2, "minItems": 1}  # fmt: skip
    for text, ok in [("[1, 2]", True), ("[1]", True), ("[]", False), ("[1, 2, 3]", False)]:
        assert produces(schema, text, strict=True) == ok, text


def test_dates_check_the_days_of_each_month() -> None:
    schema = {"type": "string", "format": "date"}
    for day, ok in [("2024-02-29", True), ("2023-02-29", False), ("2024-04-31", False),
                    ("2024-12-31", True), ("2024-13-01", False)]:  # fmt: skip
        assert produces(schema, json.dumps(day), strict=True) == ok, day
    # the exact leap-second rule takes outlines-core 8-15 s to index: loosened, and so reported
    with pytest.raises(GrammarError, match="leap second"):
        backend("outlines", True).compile(
            GrammarSpec.json_schema({"format": "date-time", "type": "string"})
        )


def test_strings_spell_what_json_allows() -> None:
    schema = {"type": "string", "maxLength": 3}
    for value in ['a"b', "\\/", "\x01", "😀"]:
        assert produces(schema, json.dumps(value, ensure_ascii=False), strict=True), value
    assert not produces(schema, json.dumps("abcd"), strict=True)


def test_strict_names_keyword_and_pointer_and_lenient_output_is_validated() -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["ids"],
              "properties": {"ids": {"type": "array", "items": {"type": "integer"},
                                     "uniqueItems": True}}}  # fmt: skip
    with pytest.raises(GrammarError, match=r"uniqueItems \(at #/properties/ids/uniqueItems\)"):
        backend("outlines", True).compile(GrammarSpec.json_schema(schema))
    with pytest.raises(GrammarError, match="strict is true"):
        backend("outlines").compile(GrammarSpec.json_schema(schema, strict=True))
    grammar = backend("outlines").compile(GrammarSpec.json_schema(schema))
    assert grammar.unenforced == ("uniqueItems",)
    text = '{"ids": [1, 1]}'
    assert walk(grammar.matcher(), encode(text)).accepted
    verdict = check_output(json.dumps(schema), text)  # what the server reports, any backend
    assert verdict.valid is False and verdict.keyword_path == "/properties/ids/uniqueItems"


def test_json_object_is_refused_at_once() -> None:
    """(outlines-core took ~40 s to index any JSON object: the server timed it out.)"""
    with pytest.raises(GrammarError, match="arbitrary JSON object"):
        backend("outlines").compile(GrammarSpec.json_object())

"""Grammar limits checked before a compile (a GrammarError naming the limit and the number), the
regex/Lark scans they read, and `\\d` read as ASCII digits in every backend path."""

from __future__ import annotations

import json
from typing import Any

import pytest

from weft.constrain import GrammarError, GrammarSpec
from weft.constrain.limits import DEFAULT_LIMITS, GrammarLimits, json_depth
from weft.constrain.regex_text import (
    RegexSize,
    ascii_classes,
    lark_ascii_classes,
    lark_repeats,
    regex_size,
)
from weft.runtime.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (r"\d+", "[0-9]+"),
        (r"[\d_]+", "[0-9_]+"),
        (r"[^\d]", "[^0-9]"),
        (r"[\D_]", "[[^0-9]_]"),
        (r"x\D", "x[^0-9]"),
        (r"\\d", r"\\d"),  # an escaped backslash, then a plain d
        (r"\p{Nd}\d", r"\p{Nd}[0-9]"),  # Unicode digits asked for by name stay
        (r"[[:alpha:]\d]{2}", r"[[:alpha:]0-9]{2}"),
        (r"(?i)\d{3}|[\]\d]", r"(?i)[0-9]{3}|[\]0-9]"),
    ],
)
def test_ascii_digits(pattern: str, expected: str) -> None:
    assert ascii_classes(pattern) == expected


def test_lark_ascii_digits_rewrites_regex_literals_only() -> None:
    grammar = 'start: "\\\\d" /\\d+/ x // a /\\d/ comment\nx: /[\\d.]/'
    assert (
        lark_ascii_classes(grammar) == 'start: "\\\\d" /[0-9]+/ x // a /\\d/ comment\nx: /[0-9.]/'
    )


@pytest.mark.parametrize(
    ("pattern", "max_repeat", "expanded", "depth"),
    [
        ("a{1000000}", 1000000, 1000000, 0),
        ("(a{1000}){1000}", 1000, 1000000, 1),
        ("(ab){5000}", 5000, 10000, 1),
        ("a{3}b{2,4}", 4, 7, 0),
        ("[a{]{5}", 5, 5, 0),  # a `{` in a class is a character
        (r"\{99999\}", 0, 7, 0),  # escaped braces are characters
        ("(?:x|y{20}){30}", 30, 630, 1),
        ("((a))", 0, 1, 2),
    ],
)
def test_regex_size(pattern: str, max_repeat: int, expanded: int, depth: int) -> None:
    assert regex_size(pattern) == RegexSize(max_repeat, expanded, depth)


def test_lark_repeats_skip_strings_comments_and_gbnf_classes() -> None:
    assert list(lark_repeats('start: "a{999}" "a"~ 10..2000 /b{77}/ // {88}')) == [10, 2000]
    gbnf = 'root ::= [^"{]* "a{999}" "a"{1000000} x{2,3} # x{5}'
    assert list(lark_repeats(gbnf)) == [1000000, 2, 3]


def deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            GrammarSpec.regex("a{1000000}"),
            "regex has a repetition count of 1000000; the limit is 10000",
        ),
        (GrammarSpec.regex("(a{1000}){1000}"), "regex expands to 1000000 items"),
        (
            GrammarSpec.regex("a" * 100_001),
            "regex is too long (100001 characters); the limit is 100000",
        ),
        (
            GrammarSpec.ebnf('root ::= "a"{1000000}'),
            "ebnf grammar has a repetition count of 1000000",
        ),
        (GrammarSpec.ebnf('start: "a"~20000'), "ebnf grammar has a repetition count of 20000"),
        (GrammarSpec.ebnf("start: /x{50000}/"), "regex /x{50000}/ has a repetition count of 50000"),
        (
            GrammarSpec.json_schema({"type": "string", "pattern": "^a{99999}$"}),
            "json_schema pattern '^a{99999}$' has a repetition count of 99999",
        ),
        (
            GrammarSpec.json_schema({"patternProperties": {"(x{500}){500}": {}}}),
            "expands to 250000 items",
        ),
        (
            GrammarSpec(
                "json_schema", json.dumps(deep_schema(200), separators=(",", ":"))
            ),  # (the constructor from a dict checks depth itself)
            "json_schema nests 201 levels deep; the limit is 128 (grammar limit max_json_depth)",
        ),
        (GrammarSpec.choices([str(i) for i in range(10_001)]), "choices has 10001 items"),
        (
            GrammarSpec.structural_tag({"format": {"type": "regex", "pattern": "[0-9]{123456}"}}),
            "structural_tag regex has a repetition count of 123456",
        ),
        (
            GrammarSpec.structural_tag(
                {
                    "format": {
                        "type": "repeat",
                        "min": 0,
                        "max": 10**9,
                        "content": {"type": "const_string", "value": "a"},
                    }
                }
            ),
            "structural_tag repeat max is 1000000000; the limit is 10000",
        ),
    ],
    ids=lambda v: v.kind if isinstance(v, GrammarSpec) else "",
)
def test_specs_beyond_a_limit_are_refused_with_the_limit(spec: GrammarSpec, message: str) -> None:
    with pytest.raises(GrammarError, match="grammar limit") as info:
        DEFAULT_LIMITS.check(spec.kind, spec.spec)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.regex(r"\d{3}-(ab){5000}"),
        GrammarSpec.ebnf('root ::= [0-9]{1,10} "x"'),
        GrammarSpec.ebnf('start: "a"~9000 /[0-9]{1,10}/'),
        GrammarSpec.json_schema(deep_schema(100)),
        GrammarSpec.json_schema({"type": "string", "pattern": "^[a-z]{1,64}$", "maxLength": 10**6}),
        GrammarSpec.choices(["yes", "no"]),
    ],
    ids=lambda s: s.kind,
)
def test_specs_within_the_limits_pass(spec: GrammarSpec) -> None:
    DEFAULT_LIMITS.check(spec.kind, spec.spec)


def test_limits_are_validated_and_can_be_tightened() -> None:
    with pytest.raises(ValueError, match="max_repeat must be a positive integer, got 0"):
        GrammarLimits(max_repeat=0)
    with pytest.raises(GrammarError, match="repetition count of 11; the limit is 10"):
        GrammarLimits(max_repeat=10).check("regex", "a{11}")


def test_json_depth_reads_without_recursion_and_skips_strings() -> None:
    assert json_depth('{"a": ["[[[", {"b": "{{"}]}') == 3
    assert json_depth("[" * 1_000_000) == 1_000_000


def test_sampling_params_refuse_a_deep_schema_at_the_boundary() -> None:
    deep = '{"items":' * 3000 + "{}" + "}" * 3000  # json.loads would raise RecursionError
    with pytest.raises(ValueError, match="nests 3001 levels deep; the limit is 128"):
        SamplingParams.from_dict({"json_schema": deep})
    with pytest.raises(ValueError, match="structural_tag nests"):
        SamplingParams.from_dict({"structural_tag": "[" * 5000})
    with pytest.raises(GrammarError, match="nests 3001 levels deep"):
        GrammarSpec.json_schema(deep)


def test_parsed_values_are_measured_without_recursion() -> None:
    with pytest.raises(GrammarError, match="json_schema nests 301 levels deep; the limit is 128"):
        GrammarSpec.json_schema(deep_schema(300))
    node: dict[str, Any] = {"type": "const_string", "value": "a"}
    for _ in range(2000):  # deeper than the structural checks could recurse
        node = {"type": "optional", "content": node}
    with pytest.raises(GrammarError, match="structural_tag nests 2002 levels deep"):
        GrammarSpec.structural_tag({"format": node})

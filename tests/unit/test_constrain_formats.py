"""The `format` regexes (constrain/formats.py): the JSON-Schema-Test-Suite's optional/format cases,
Python's own parsers (ipaddress, datetime, uuid) on generated strings, the schema rewrite, and
the grammar built from it (strict mode refuses the one inexact format)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import re
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_constrain_support import STOP, backend, tokenizer

from weft.constrain import CompiledGrammar, GrammarError, GrammarSpec, conformance
from weft.constrain.formats import (
    FORMAT_REGEXES,
    REGEX_MAX_DEPTH,
    conforms,
    format_pattern,
    format_patterns,
)

SUITE = conformance.DEFAULT_SUITE / "draft2020-12" / "optional" / "format"
EXAMPLES = settings(max_examples=300, deadline=None)


def _suite_cases(name: str) -> list[tuple[str, bool, str]]:
    if not SUITE.is_dir():
        pytest.skip(f"the JSON-Schema-Test-Suite is not at {SUITE}")
    cases = json.loads((SUITE / f"{name}.json").read_text())
    return [
        (t["data"], t["valid"], t["description"])
        for case in cases
        for t in case["tests"]
        if isinstance(t["data"], str)
    ]


@pytest.mark.parametrize("name", sorted(FORMAT_REGEXES))
def test_suite_cases(name: str) -> None:
    wrong = [(d, v, why) for d, v, why in _suite_cases(name) if conforms(name, d) != v]
    assert not wrong


@pytest.mark.parametrize("name", sorted(FORMAT_REGEXES))
def test_regexes_read_alike_in_python_and_llguidance(name: str) -> None:
    """Each regex is one llguidance compiles (no Python-only syntax, every class plain ASCII)."""
    pattern = format_pattern(name)
    assert pattern is not None and re.compile(pattern)
    assert not re.search(r"\\[dwsDWSb]|\(\?[=!<P]", pattern)


##### Python's parsers on generated strings #####

_IP_CHARS = st.text("0123456789abcdefABCDEF:.", min_size=1, max_size=20)


@EXAMPLES
@given(st.ip_addresses(v=4))
def test_ipv4_addresses(address: ipaddress.IPv4Address) -> None:
    assert conforms("ipv4", str(address))


@EXAMPLES
@given(st.text("0123456789.", min_size=1, max_size=16))
def test_ipv4_like_text_as_ipaddress(text: str) -> None:
    try:
        ipaddress.IPv4Address(text)
        valid = True
    except ValueError:
        valid = False
    assert conforms("ipv4", text) == valid


@EXAMPLES
@given(st.ip_addresses(v=6))
def test_ipv6_addresses(address: ipaddress.IPv6Address) -> None:
    assert conforms("ipv6", str(address)) and conforms("ipv6", address.exploded)
    assert conforms("ipv6", f"::ffff:{ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)}")


@EXAMPLES
@given(st.one_of(_IP_CHARS, st.lists(st.sampled_from(["", "0", "ff", "1a2b", "1.2.3.4"]),
                                     min_size=1, max_size=10).map(":".join)))  # fmt: skip
def test_ipv6_like_text_as_ipaddress(text: str) -> None:
    try:
        ipaddress.IPv6Address(text)
        valid = True
    except ValueError:
        valid = False
    assert conforms("ipv6", text) == valid


@EXAMPLES
@given(st.dates())
def test_dates(day: dt.date) -> None:
    assert conforms("date", day.isoformat())


@EXAMPLES
@given(st.from_regex(r"\A[0-9]{4}-[0-3][0-9]-[0-3][0-9]\Z"))
def test_date_shaped_text_as_fromisoformat(text: str) -> None:
    try:
        dt.date.fromisoformat(text)
        valid = True
    except ValueError:
        valid = False
    assert conforms("date", text) == valid


@settings(max_examples=100, deadline=None)
@given(st.datetimes(timezones=st.timezones()), st.sampled_from(["T", "t"]))
def test_datetimes(when: dt.datetime, sep: str) -> None:
    when = when.replace(tzinfo=dt.timezone(when.utcoffset() or dt.timedelta()))
    if when.utcoffset() != when.utcoffset() // dt.timedelta(minutes=1) * dt.timedelta(minutes=1):
        when = when.replace(tzinfo=dt.timezone.utc)  # RFC 3339 offsets have no seconds
    text = when.isoformat(sep=sep)
    assert conforms("date-time", text), text
    assert conforms("time", text.partition(sep)[2])


@EXAMPLES
@given(st.integers(0, 23), st.integers(0, 59), st.sampled_from("+-"), st.integers(0, 23),
       st.integers(0, 59))  # fmt: skip
def test_leap_seconds_only_at_2359_utc(hour: int, minute: int, sign: str, oh: int, om: int) -> None:
    text = f"{hour:02d}:{minute:02d}:60{sign}{oh:02d}:{om:02d}"
    utc = (hour * 60 + minute - (1 if sign == "+" else -1) * (oh * 60 + om)) % (24 * 60)
    assert conforms("time", text) == (utc == 23 * 60 + 59), text
    assert conforms("date-time", "1998-12-31T" + text) == (utc == 23 * 60 + 59)


@EXAMPLES
@given(st.uuids())
def test_uuids(value: uuid.UUID) -> None:
    assert conforms("uuid", str(value)) and conforms("uuid", str(value).upper())
    assert not conforms("uuid", value.hex) and not conforms("uuid", value.urn)


def test_hostnames_decode_a_labels() -> None:
    assert conforms("hostname", "xn--9n2bp8q.xn--9t4b11yi5a")
    assert not conforms("hostname", "xn--X") and not conforms("hostname", "ab--c")
    assert not conforms("hostname", ".".join(["a" * 63] * 4))  # 255 characters
    assert conforms("hostname", ".".join(["a" * 63] * 3 + ["a" * 61]))  # 253


##### The schema rewrite and its grammar #####


def test_format_patterns_rewrite() -> None:
    schema = {
        "properties": {
            "when": {"type": "string", "format": "date"},
            "host": {"format": "hostname", "maxLength": 300},
            "day": {"format": "date", "pattern": "^19"},
            "other": {"format": "uri-template"},
        }
    }
    rewritten, inexact = format_patterns(schema)
    props = rewritten["properties"]
    assert props["when"] == {"type": "string", "pattern": format_pattern("date")}
    assert props["host"] == {"pattern": format_pattern("hostname"), "maxLength": 253}
    assert props["day"] == {"pattern": "^19", "allOf": [{"pattern": format_pattern("date")}]}
    assert props["other"] == {"format": "uri-template"}  # not weft's: left to the library
    assert inexact == ["format:hostname"] and schema["properties"]["when"]["format"] == "date"
    plain = {"type": "string"}
    assert format_patterns(plain) == (plain, [])


def _produces(grammar: CompiledGrammar, text: str) -> bool:
    ids = tokenizer().encode(text, add_special_tokens=False)
    return conformance.walk(grammar.matcher(), ids, STOP, backend("llguidance"))


def _grammar_produces(schema: dict[str, object], value: object, strict: bool = False) -> bool:
    grammar = backend("llguidance").compile(GrammarSpec.json_schema(schema, strict=strict))
    return _produces(grammar, json.dumps(value))


def test_grammar_enforces_formats() -> None:
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}
    assert _grammar_produces(schema, {"d": "2020-02-29"}, strict=True)
    assert not _grammar_produces(schema, {"d": "2021-02-29"}, strict=True)
    email = {"type": "string", "format": "email"}
    assert _grammar_produces(email, '"joe bloggs"@example.com', strict=True)
    assert not _grammar_produces(email, "joe bloggs@example.com", strict=True)


def test_strict_refuses_hostname_and_lenient_reports_it() -> None:
    schema = {"properties": {"h": {"type": "string", "format": "hostname"}}}
    with pytest.raises(GrammarError, match=r"format:hostname \(A-labels.*\(at #/properties/h"):
        backend("llguidance").compile(GrammarSpec.json_schema(schema, strict=True))
    grammar = backend("llguidance").compile(GrammarSpec.json_schema(schema))
    assert "format:hostname" in grammar.unenforced
    assert _produces(grammar, '{"h": "example.com"}')
    assert not _produces(grammar, '{"h": "-example.com"}')


def test_regex_format_is_ecma262_syntax_up_to_its_nesting_bound() -> None:
    schema = {"type": "string", "format": "regex"}
    for valid in ["(?<n>a)\\k<n>", "[^]", "^([abc])+\\s+$", "\\p{L}|x(?i:y)", "a{2,3}?"]:
        assert _grammar_produces(schema, valid), valid
    for invalid in ["(?P<n>a)", "(?i)a", "(?#c)", "\\a", "a**", "{", "^(abc]"]:
        assert not _grammar_produces(schema, invalid), invalid
    deep = "(" * REGEX_MAX_DEPTH + "a" + ")" * REGEX_MAX_DEPTH
    assert _grammar_produces(schema, deep) and not _grammar_produces(schema, f"({deep})")
    assert conforms("regex", f"({deep})")  # the validation has no bound
    with pytest.raises(GrammarError, match=r"format:regex \(back-references"):
        backend("llguidance").compile(GrammarSpec.json_schema(schema, strict=True))

"""The validation's own format checks (constrain/format_checks.py): `regex` as ECMA-262 (u-mode)
and `idn-hostname` under IDNA2008 with the Bidi rule, on the suite's cases and on what Python's
`re` and a bare idna.encode get wrong; and the server's verdict (check_output) with them."""

from __future__ import annotations

import json

import pytest
from test_constrain_formats import _suite_cases

from weft.constrain.format_checks import ecma262_error, idn_hostname_ok
from weft.constrain.validation import check_output


@pytest.mark.parametrize("name", ["regex", "idn-hostname"])
def test_suite_cases(name: str) -> None:
    def ok(text: str) -> bool:
        return ecma262_error(text) is None if name == "regex" else idn_hostname_ok(text)

    cases = _suite_cases(name)
    assert cases
    assert [(d, v, why) for d, v, why in cases if ok(d) != v] == []


@pytest.mark.parametrize(
    "pattern",
    [
        "", "a|", "[]", "[^]", "\\cA", "(?<=a+)b", "(?<n>a)\\k<n>", "\\k<x>(?<x>a)", "\\1(a)",
        "(?<a>x)|(?<a>y)", "(?i:ab)", "(?-i:ab)", "(?m-s:a)", "a{2}?", "a{2,}", "a{0,3}",
        "[\\d-]", "[\\-]", "[\\b]", "\\/", "\\p{L}", "\\p{Script=Greek}", "\\u{1F600}",
        "\\u0041", "\\x41", "\\0", "^(?:a|b)*$", "(?!a)b", "[a-z0-9_]+", "\\$",
    ],
)  # fmt: skip
def test_valid_ecma262(pattern: str) -> None:
    assert ecma262_error(pattern) is None


@pytest.mark.parametrize(
    "pattern",
    [
        "\\a", "(?P<n>a)", "(?P<n>a)(?P=n)", "(?#c)a", "(?i)abc", "(?-:a)", "(?ii:a)",
        "(?<a>x)(?<a>y)", "\\2(a)", "\\k<x>", "a{2,1}", "a**", "a{", "a{,3}", "}", "]", "^*",
        "(?=a)*", "(", ")", "[z-a]", "[a-\\d]", "\\-", "\\00", "\\x4", "\\u12", "\\p{}",
        "\\q", "[\\B]", "[\\1]", "\\",
    ],
)  # fmt: skip
def test_invalid_ecma262(pattern: str) -> None:
    error = ecma262_error(pattern)
    assert error is not None and "offset" in error


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("münchen.de", True), ("xn--mnchen-3ya.de", True), ("例え.テスト", True),
        ("ب٠ب", True), ("מבחן.example", True), ("מבחן.1abc", False),  # a digit-first label
        ("example.", False), ("example。", False), ("example．", False), ("example｡", False),
        ("a..b", False), ("", False), ("0a.א", False), ("-a.de", False),
    ],
)  # fmt: skip
def test_idn_hostnames(name: str, ok: bool) -> None:
    assert idn_hostname_ok(name) is ok


def test_check_output_flags_python_only_regex_and_trailing_dots() -> None:
    regex = json.dumps({"type": "string", "format": "regex"})
    assert check_output(regex, json.dumps("(?<n>a)\\k<n>")).valid is True
    bad = check_output(regex, json.dumps("(?P<n>a)"))
    assert bad.valid is False and "regex" in bad.message
    host = json.dumps({"type": "string", "format": "idn-hostname"})
    assert check_output(host, json.dumps("例え.テスト")).valid is True
    assert check_output(host, json.dumps("例え.テスト。")).valid is False

"""The JSON-Schema-Test-Suite conformance table (constrain/conformance.py), recomputed and held to
the checked-in one (tests/data/constrain/conformance.json): no mode may accept fewer schemas or
make more wrong decisions in any keyword file. Regenerate the table after an improvement:

    python -m weft.constrain.conformance --optional-format \\
        --json tests/data/constrain/conformance.json --markdown docs/conformance-table.md

optional/format/ is measured too: the formats weft enforces (formats.py) make no wrong decision
in strict mode, and lenient's wrong acceptances under any format are all flagged (or unchecked).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from test_constrain_support import DATA, suite_results

from weft.constrain import conformance
from weft.constrain.conformance import CaseResult
from weft.constrain.formats import FORMAT_REGEXES, INEXACT_FORMATS
from weft.constrain.validation import STANDARD_FORMATS, check_output

TABLE = DATA / "conformance.json"

pytestmark = pytest.mark.skipif(
    not (conformance.DEFAULT_SUITE / "draft2020-12").is_dir(),
    reason=f"the JSON-Schema-Test-Suite is not at {conformance.DEFAULT_SUITE}",
)


@functools.cache
def results() -> dict[str, list[CaseResult]]:
    return suite_results(conformance.MODES)


def table() -> dict[str, Any]:
    return conformance.table_json(results())


def test_no_regression_against_the_checked_in_table() -> None:
    worse = conformance.regressions(table(), json.loads(TABLE.read_text()))
    assert not worse, "\n".join(worse)


def test_strict_makes_no_wrong_decision() -> None:
    total = table()["strict"]["total"]
    assert total["wrong_rejections"] == total["wrong_acceptances"] == 0, total
    # weft's strict accepts more than the library's own strict mode
    assert total["accepted"] > table()["llguidance-strict"]["total"]["accepted"]


def test_lenient_validation_flags_every_wrong_acceptance() -> None:
    """What lenient lets through, the server reports (schema_valid false), except where the
    schema refers to a document weft never fetches, or uses a standard format the validator has
    no checker for (schema_valid null: unchecked, never true)."""
    unflagged = [(r.file, r.case, r.unflagged) for r in results()["lenient"] if r.unflagged]
    assert not unflagged, unflagged
    unchecked = [r for r in results()["lenient"] if r.unchecked]
    assert all("$ref" in json.dumps(_schema(r)) or _format_of(r.file) in STANDARD_FORMATS
               for r in unchecked)  # fmt: skip
    assert {_format_of(r.file) for r in unchecked if not r.file.startswith("ref")} >= {
        "iri",
        "iri-reference",
        "uri-template",
    }


def _format_of(file: str) -> str:
    return file.removeprefix("optional/format/").removesuffix(".json")


def test_enforced_formats_make_no_wrong_decision() -> None:
    rows = table()["lenient"]["files"]
    for name in FORMAT_REGEXES:
        row = rows[f"optional/format/{name}.json"]
        assert row["wrong_rejections"] == row["unflagged"] == 0, (name, row)
        # only the inexact formats (hostname's A-labels, regex's back-references ...) leave
        # anything to the output validation
        assert row["wrong_acceptances"] == 0 or name in INEXACT_FORMATS, (name, row)


def test_strict_refusals_name_keyword_and_pointer() -> None:
    for r in results()["strict"]:
        if r.refusal.startswith("unsupported JSON schema keyword(s): ") and r.file in (
            "uniqueItems.json",
            "not.json",
            "optional/format/hostname.json",
        ):
            assert "(at #" in r.refusal, r.refusal


def test_respellings() -> None:
    got = set(conformance.respellings({"a": 1.0, "b": [2.0]}))
    assert got == {'{"a":1,"b":[2]}', '{"b":[2],"a":1}'}


def test_markdown_table_lists_every_file() -> None:
    text = conformance.table_markdown(table())
    assert text.count("| uniqueItems.json |") == len(conformance.MODES)


@functools.cache
def _suite() -> dict[tuple[str, str], Any]:
    out = {}
    for path in conformance.suite_files(conformance.DEFAULT_SUITE, optional_format=True):
        for case in json.loads(path.read_text()):
            out[conformance.file_name(path), case["description"]] = case["schema"]
    return out


def _schema(r: CaseResult) -> Any:
    return _suite()[r.file, r.case]


def test_check_output_reports_the_first_error() -> None:
    schema = json.dumps({"type": "object", "properties": {"ids": {"uniqueItems": True}}})
    assert check_output(schema, '{"ids": [1, 2]}').meta() == {"schema_valid": True}
    bad = check_output(schema, '{"ids": [1, 1]}')
    assert (bad.valid, bad.path, bad.keyword_path) == (False, "/ids", "/properties/ids/uniqueItems")
    cut = check_output(schema, '{"ids": [1,').meta()
    assert (
        cut["schema_valid"] is False and "not one JSON document" in cut["schema_error"]["message"]
    )
    assert check_output(schema, "NaN").valid is False
    remote = check_output(json.dumps({"$ref": "http://example.invalid/s.json"}), "1")
    assert remote.valid is None and "could not be checked" in remote.message
    email = json.dumps({"type": "string", "format": "email"})
    assert check_output(email, '"nobody"').valid is False  # formats are asserted

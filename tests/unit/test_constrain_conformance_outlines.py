"""The JSON-Schema-Test-Suite conformance table of the outlines backend (constrain/conformance.py's
`outlines` and `outlines-strict` modes), recomputed in full and held to the checked-in one
(tests/data/constrain/conformance-outlines.json). Both modes over the whole suite (optional/format
included) take ~20 s on 2 cores: outlines-core's indexes are built by the backend's two worker
processes, once per process (cached). Regenerate the table after an improvement:

    python -m weft.constrain.conformance --modes outlines,outlines-strict --optional-format \\
        --json tests/data/constrain/conformance-outlines.json
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from test_constrain_support import DATA, suite_results

from weft.constrain import conformance
from weft.constrain.conformance import CaseResult

TABLE = DATA / "conformance-outlines.json"

pytestmark = pytest.mark.skipif(
    not (conformance.DEFAULT_SUITE / "draft2020-12").is_dir(),
    reason=f"the JSON-Schema-Test-Suite is not at {conformance.DEFAULT_SUITE}",
)


@functools.cache
def results() -> dict[str, list[CaseResult]]:
    return suite_results(conformance.OUTLINES_MODES)


@functools.cache
def table() -> dict[str, Any]:
    return conformance.table_json(results())


def test_no_regression_against_the_checked_in_table() -> None:
    worse = conformance.regressions(table(), json.loads(TABLE.read_text()))
    assert not worse, "\n".join(worse)


def test_no_wrong_rejection_in_either_mode() -> None:
    """A schema whose valid instances the grammar cannot all write is refused instead."""
    for mode in conformance.OUTLINES_MODES:
        assert table()[mode]["total"]["wrong_rejections"] == 0, (mode, table()[mode]["total"])


def test_strict_makes_no_wrong_decision() -> None:
    total = table()["outlines-strict"]["total"]
    assert total["wrong_rejections"] == total["wrong_acceptances"] == 0, total
    assert table()["outlines"]["total"]["accepted"] >= total["accepted"]


def test_lenient_validation_flags_every_wrong_acceptance() -> None:
    """What lenient lets through, the server reports as schema_valid false (the validation is
    the backend's own: validation.check_output, whatever the grammar)."""
    total = table()["outlines"]["total"]
    assert total["unflagged"] == total["unchecked"] == 0, total
    lenient = {(r.file, r.case): r for r in results()["outlines"]}
    for r in results()["outlines-strict"]:
        if not r.accepted and r.refusal.startswith("unsupported JSON schema keyword(s)"):
            assert lenient[r.file, r.case].accepted, (r.file, r.case)


def test_strict_refusals_name_keyword_and_pointer() -> None:
    refusals = [
        r.refusal
        for r in results()["outlines-strict"]
        if r.refusal.startswith("unsupported JSON schema keyword(s) for outlines: ")
    ]
    assert refusals
    for text in refusals:
        assert "at #" in text, text


def test_refusals_say_why() -> None:
    """Untyped schemas are refused for the arbitrary arrays and objects they allow, not for an
    internal error or a compile timeout."""
    for mode in conformance.OUTLINES_MODES:
        for r in results()[mode]:
            assert "internal error" not in r.refusal and "timed out" not in r.refusal, r
    refusal = next(r.refusal for r in results()["outlines"] if r.file == "maxLength.json")
    assert "arbitrary JSON array" in refusal

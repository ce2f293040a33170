"""benchmarks/host.py: a folder of schemas compiled per backend with refusals named, and the
tool-parser and stop-regex tables (what they report, not how fast)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as top-level modules

import host  # noqa: E402
import host_grammar  # noqa: E402


def test_counts_compiled_unenforced_and_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schemas = {
        "a_plain.json": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b_unique.json": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "c_broken.json": {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}},
    }
    for name, schema in schemas.items():
        (tmp_path / name).write_text(json.dumps(schema))
    host.main(["schemas", str(tmp_path), "--backends", "llguidance,llguidance:strict"])
    out = capsys.readouterr().out
    assert "3 schemas from" in out
    assert "| llguidance | 2/3 | 66.7% | 1 | 0 | 1 |" in out  # uniqueItems left unenforced
    assert "| llguidance:strict | 1/3 | 33.3% | 0 | 0 | 2 |" in out  # ... or refused
    assert "llguidance: keywords reported as not enforced (schemas): uniqueItems 1" in out
    assert "llguidance refused c_broken.json:" in out
    assert "llguidance:strict refused b_unique.json:" in out


def test_a_folder_without_schemas_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no \\*.json files"):
        host_grammar.load_schemas(tmp_path)
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="object or a boolean"):
        host_grammar.load_schemas(tmp_path)


def test_tool_parser_and_stop_regex_tables(capsys: pytest.CaptureFixture[str]) -> None:
    host.main(["tool-parser", "--lengths", "100", "1000", "--repeats", "1"])
    host.main(["stop-regex", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "| 147 |" in out and "| 1,047 |" in out  # the JSON text around the argument
    assert "| `(a\\|aa)+b` | 60 chars |" in out and "| StopRegexTimeout |" in out
    assert "| `END` | 63 chars |" in out and "| match |" in out

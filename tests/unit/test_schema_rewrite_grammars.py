"""The exact schema rewrites as llguidance grammars: each case of test_schema_rewrite_cases.py
compiles in strict mode, enforcing everything, and the grammar agrees with jsonschema on random
instances (one it writes is valid; a valid one it writes in some spelling); a rewrite the library
cannot compile leaves the schema as written."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from test_constrain_support import backend, encode, walk
from test_schema_rewrite_cases import CASES, INSTANCES, is_valid

from weft.constrain import GrammarError, GrammarSpec
from weft.constrain.base import CompiledGrammar
from weft.constrain.conformance import respellings

_COMPILED: dict[str, CompiledGrammar] = {}


def compiled(schema: Any, strict: bool = True) -> CompiledGrammar:
    key = json.dumps([schema, strict])
    if key not in _COMPILED:
        _COMPILED[key] = backend("llguidance", strict=strict).compile(
            GrammarSpec.json_schema(schema)
        )
    return _COMPILED[key]


def writes(grammar: CompiledGrammar, text: str) -> bool:
    return walk(grammar.matcher(), encode(text)).accepted


@pytest.mark.parametrize("schema", [s for _, s in CASES], ids=[n for n, _ in CASES])
def test_strict_accepts_each_case(schema: Any) -> None:
    assert compiled(schema).unenforced == ()


@settings(max_examples=40, deadline=None)
@pytest.mark.parametrize("schema", [s for _, s in CASES], ids=[n for n, _ in CASES])
@given(instance=INSTANCES)
def test_grammar_agrees_with_jsonschema(schema: Any, instance: Any) -> None:
    grammar = compiled(schema)
    compact = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
    spaced = json.dumps(instance, ensure_ascii=False)
    valid = is_valid(schema, instance)
    if writes(grammar, compact) or writes(grammar, spaced):
        assert valid, (schema, compact)
    elif valid:
        # NOTE: the library writes an object's keys in one order (required ones first)
        others = respellings(instance, limit=720)
        assert any(writes(grammar, text) for text in others), (schema, compact)


def test_integral_consts_take_both_spellings() -> None:
    grammar = compiled({"enum": [1, -2, {"a": 0, "b": [3]}, "s"]})
    for text in ("1", "1.0", "-2", "-2.0", '{"a":0,"b":[3.0]}', '{"b":[3],"a":0.0}', '"s"'):
        assert writes(grammar, text), text
    for text in ("1.5", "2", '{"a":0}', '{"a":0,"b":[3],"c":1}'):
        assert not writes(grammar, text), text


def test_a_rewrite_the_library_cannot_compile_leaves_the_schema_as_written() -> None:
    # the names' pattern meets the schema's own patternProperties: the library wants them disjoint
    schema = {"patternProperties": {"^a": {"type": "string"}}, "propertyNames": {"pattern": "^ab"}}
    assert compiled(schema, strict=False).unenforced == ("propertyNames",)
    with pytest.raises(GrammarError, match="propertyNames"):
        compiled(schema)
    # no array is unique here: the rewrite is unsatisfiable, the schema as written is not refused
    dupes = {"type": "array", "items": {"const": 1}, "minItems": 2, "uniqueItems": True}
    assert compiled(dupes, strict=False).unenforced == ("uniqueItems",)


def test_refusals_still_name_keyword_and_pointer() -> None:
    with pytest.raises(GrammarError, match=r"not \(at #/properties/a/not\)"):
        compiled({"properties": {"a": {"not": {"type": "integer"}}}})

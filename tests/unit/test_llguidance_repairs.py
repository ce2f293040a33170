"""llguidance's repairs: a remote `$ref` or a `pattern` the library cannot compile is dropped and
reported as not enforced (lenient), or refuses the schema naming it (strict)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from test_constrain_support import backend, encode, walk

from weft.constrain import GrammarError, GrammarSpec
from weft.constrain.llguidance_backend import MAX_REPAIRS
from weft.constrain.schema import without_remote_refs

OTHER = "https://example.com/other.json"
DRAFT7 = "http://json-schema.org/draft-07/schema#"
DRAFT4 = "http://json-schema.org/draft-04/schema#"
UNKNOWN_DIALECT = "https://json.schemastore.org/metaschema-draft-07-unofficial-strict.json"


def lenient(schema: dict[str, Any]) -> Any:
    return backend("llguidance").compile(GrammarSpec.json_schema(schema))


def accepts(compiled: Any, text: str) -> bool:
    return walk(compiled.matcher(), encode(text)).accepted


def test_a_remote_ref_is_dropped_reported_and_the_rest_still_enforced() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"$ref": f"{OTHER}#/definitions/a"},
            "b": {"$ref": OTHER, "type": "string"},  # a sibling of the $ref stays enforced
            "n": {"type": "integer"},
        },
        "required": ["a", "b", "n"],
        "additionalProperties": False,
    }
    before = copy.deepcopy(schema)
    compiled = lenient(schema)
    assert compiled.unenforced == (f"$ref:{OTHER}",)
    assert schema == before  # the caller's schema is never mutated
    assert accepts(compiled, '{"a": [1, "x"], "b": "s", "n": 3}')  # `a` accepts any value
    assert not accepts(compiled, '{"a": 1, "b": "s", "n": "x"}')
    assert not accepts(compiled, '{"a": 1, "b": 5, "n": 3}')
    assert not accepts(compiled, '{"a": 1, "b": "s", "n": 3, "c": 0}')


def test_a_relative_ref_is_resolved_against_the_id_in_scope() -> None:
    schema = {
        "$id": "https://example.com/schemas/root.json",
        "type": "object",
        "properties": {
            "a": {"$ref": "defs.json#/x"},
            "b": {
                "$id": "https://other.org/v1/",
                "type": "object",
                "properties": {"c": {"$ref": "types.json"}, "d": {"type": "boolean"}},
            },
        },
        "required": ["a", "b"],
    }
    compiled = lenient(schema)
    assert set(compiled.unenforced) == {
        "$ref:https://example.com/schemas/defs.json",
        "$ref:https://other.org/v1/types.json",
    }
    assert accepts(compiled, '{"a": 1, "b": {"c": "x", "d": true}}')
    assert not accepts(compiled, '{"a": 1, "b": {"c": "x", "d": 0}}')
    # no $id: the library's default base; draft-04: `id`, not `$id`
    assert lenient({"properties": {"a": {"$ref": "o.json"}}}).unenforced == (
        "$ref:json-schema:///o.json",
    )
    nested = {"$id": "sub/dir/x.json", "properties": {"b": {"$ref": "../y.json#/q"}}}
    assert lenient({"properties": {"a": nested}}).unenforced == ("$ref:json-schema:///sub/y.json",)
    draft4 = {"$schema": DRAFT4, "id": "https://example.com/a/b.json"}
    assert lenient({**draft4, "properties": {"a": {"$ref": "o.json#/p"}}}).unenforced == (
        "$ref:https://example.com/a/o.json",
    )


def test_strict_refuses_a_remote_ref_naming_it() -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": f"{OTHER}#/x"}}}
    message = f"remote \\$ref '{OTHER}' is not supported: weft does not fetch"
    with pytest.raises(GrammarError, match=message) as info:
        backend("llguidance", strict=True).compile(GrammarSpec.json_schema(schema))
    assert info.value.keywords == (f"$ref:{OTHER}",)
    assert "strict is true" not in str(info.value)
    with pytest.raises(GrammarError, match=message + ".*strict is true"):
        backend("llguidance").compile(GrammarSpec.json_schema(schema, strict=True))


def test_refs_in_const_and_enum_data_are_left_alone() -> None:
    data = {"$ref": OTHER}
    schema = {
        "type": "object",
        "properties": {
            "a": {"$ref": OTHER},
            "k": {"const": data, "default": data, "examples": [data]},
            "e": {"enum": [data, 1]},
        },
        "required": ["a", "k", "e"],
        "additionalProperties": False,
    }
    plain, removed = without_remote_refs(schema, OTHER)
    assert removed == 1 and plain["properties"]["a"] == {}
    assert plain["properties"]["k"] == schema["properties"]["k"]
    assert plain["properties"]["e"] == schema["properties"]["e"]
    compiled = lenient(schema)
    assert compiled.unenforced == (f"$ref:{OTHER}",)
    assert accepts(compiled, f'{{"a": 0, "k": {{"$ref": "{OTHER}"}}, "e": 1}}')
    assert not accepts(compiled, '{"a": 0, "k": {}, "e": 1}')


@pytest.mark.parametrize(
    "where",
    [
        {"type": "object", "dependencies": {"a": {"$ref": OTHER}, "b": ["a"]}},
        {"type": "array", "items": [{"type": "integer"}], "additionalItems": {"$ref": OTHER}},
        {"type": "array", "items": [{"$ref": OTHER}]},
    ],
)
def test_the_walker_reaches_every_subschema_position(where: dict[str, Any]) -> None:
    compiled = lenient({"$schema": DRAFT7, **where})
    assert f"$ref:{OTHER}" in compiled.unenforced
    unevaluated = lenient({"type": "object", "unevaluatedProperties": {"$ref": OTHER}})
    assert f"$ref:{OTHER}" in unevaluated.unenforced


@pytest.mark.parametrize("pattern", ["\\bfoo", "^(?=a)[a-z]+$"])
def test_a_pattern_the_library_cannot_compile_is_dropped_or_refused(pattern: str) -> None:
    schema = {
        "type": "object",
        "properties": {
            "w": {"type": "string", "pattern": pattern},
            "d": {"type": "string", "pattern": "^[0-9]+$"},
        },
        "required": ["w", "d"],
        "additionalProperties": False,
    }
    compiled = lenient(schema)
    assert compiled.unenforced == ("pattern",)
    assert accepts(compiled, '{"w": "xyz", "d": "12"}')
    assert not accepts(compiled, '{"w": "xyz", "d": "ab"}')  # the other pattern still holds
    with pytest.raises(GrammarError, match="keyword\\(s\\): pattern") as info:
        backend("llguidance", strict=True).compile(GrammarSpec.json_schema(schema))
    assert info.value.keywords == ("pattern",) and pattern in str(info.value)
    with pytest.raises(GrammarError, match="keyword\\(s\\): pattern.*strict is true"):
        backend("llguidance").compile(GrammarSpec.json_schema(schema, strict=True))


def test_a_pattern_properties_key_the_library_cannot_compile_stays_refused() -> None:
    schema = {"type": "object", "patternProperties": {"^(?=a)": {"type": "integer"}}}
    with pytest.raises(GrammarError, match="invalid json_schema: regex parse error"):
        lenient(schema)


def test_the_unknown_dialect_repair_combines_with_the_others() -> None:
    schema = {
        "$schema": UNKNOWN_DIALECT,
        "type": "object",
        "properties": {
            "a": {"$ref": OTHER},
            "w": {"type": "string", "pattern": "\\bw"},
            "n": {"type": "integer"},
        },
        "required": ["n"],
    }
    compiled = lenient(schema)
    assert set(compiled.unenforced) == {"$schema", f"$ref:{OTHER}", "pattern"}
    assert accepts(compiled, '{"a": null, "w": "x", "n": 1}')
    assert not accepts(compiled, '{"n": "1"}')
    with pytest.raises(GrammarError, match="strict is true") as info:  # the library's first error
        backend("llguidance").compile(GrammarSpec.json_schema(schema, strict=True))
    assert len(info.value.keywords) == 1 and info.value.keywords[0] in compiled.unenforced


def test_a_remote_ref_the_walker_cannot_reach_is_refused_not_looped_on() -> None:
    # `contentSchema` is no subschema position weft walks, but the library resolves its $ref
    hidden = {"type": "object", "properties": {"a": {"contentSchema": {"$ref": OTHER}}}}
    with pytest.raises(GrammarError, match=f"remote \\$ref '{OTHER}' is not supported"):
        lenient(hidden)
    # more remote documents than repair rounds: refused with the same clear message
    many = {f"p{i}": {"$ref": f"https://example.com/d{i}.json"} for i in range(MAX_REPAIRS + 1)}
    with pytest.raises(GrammarError, match="remote \\$ref 'https://example.com/d"):
        lenient({"type": "object", "properties": many})
    few = dict(list(many.items())[:MAX_REPAIRS])
    assert len(lenient({"type": "object", "properties": few}).unenforced) == MAX_REPAIRS

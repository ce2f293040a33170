"""Recursive `$ref`s with sibling keywords (constrain/schema_refs.py): merged into definitions, so
llguidance compiles them, exactly: documents walked through the grammar agree with `jsonschema`."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest
from test_constrain_support import backend, encode, walk

from weft.constrain import GrammarError, GrammarSpec
from weft.constrain.schema_refs import merged_sibling_refs

NODE = {
    "type": "object",
    "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node", "required": ["value"]}},
    },
}
TREE = {"$defs": {"node": NODE}, "$ref": "#/$defs/node", "required": ["children"]}
LINKED = {
    "$defs": {
        "item": {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "next": {"$ref": "#/$defs/item", "required": ["id"]},
            },
        }
    },
    "type": "object",
    "properties": {"head": {"$ref": "#/$defs/item"}},
}
DOCS = [
    {"children": []},
    {"children": [{"value": 1}]},
    {"children": [{"value": 1, "children": [{"value": 2, "children": []}]}]},
    {},
    {"children": [{}]},
    {"children": [{"value": 1, "children": [{"children": []}]}]},
    {"children": [{"value": "1"}]},
    {"head": {"id": "a", "next": {"id": "b", "next": {}}}},
    {"head": {"id": "a"}},
    {"head": {}},
    {"head": {"id": "a", "next": {"next": {"id": 1}}}},
]


def test_the_library_refuses_them_as_written() -> None:
    grammar = '{"grammars": [{"json_schema": %s}]}'
    for schema in (TREE, LINKED):
        error = llguidance.LLMatcher.validate_grammar(grammar % json.dumps(schema))
        assert "circular references with sibling keys" in error


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("schema", [TREE, LINKED], ids=["tree", "linked"])
def test_recursive_refs_with_siblings_compile_exactly(schema: Any, strict: bool) -> None:
    grammar = backend("llguidance", strict=strict).compile(GrammarSpec.json_schema(schema))
    assert not grammar.unenforced
    checked = 0
    for doc in DOCS:
        valid = jsonschema.Draft202012Validator(schema).is_valid(doc)
        for text in (json.dumps(doc), json.dumps(doc, separators=(",", ":"))):
            assert walk(grammar.matcher(), encode(text)).accepted == valid, (doc, text)
        checked += valid
    assert checked >= 2


def test_merged_definitions_name_each_target_and_siblings_once() -> None:
    merged = merged_sibling_refs(TREE)
    assert merged["$ref"] == "#/$defs/node" and merged["required"] == ["children"]
    node = merged["$defs"]["weft-merged-0"]
    assert node["required"] == ["value"]
    assert node["properties"]["children"]["items"] == {"$ref": "#/$defs/weft-merged-0"}
    assert (
        merged["$defs"]["node"]["properties"]["children"]["items"]
        == node["properties"]["children"]["items"]
    )


@pytest.mark.parametrize(
    "siblings",
    [
        {"type": "string"},  # a keyword on both sides that shares nothing
        {"additionalProperties": False},  # reads the target's `properties`
        {"unevaluatedProperties": False},
    ],
)
def test_what_is_not_a_plain_union_is_left_to_the_library(siblings: dict[str, Any]) -> None:
    items = {"$ref": "#/$defs/node", **siblings}
    schema = {"$defs": {"node": {**NODE, "properties": {"children": {"items": items}}}}}
    schema["$ref"] = "#/$defs/node"
    assert merged_sibling_refs(schema) is schema
    with pytest.raises(GrammarError):
        backend("llguidance").compile(GrammarSpec.json_schema(schema))


def test_schemas_without_them_are_untouched() -> None:
    plain = {"$defs": {"node": NODE}, "$ref": "#/$defs/node"}
    top = {"$defs": {"n": {"type": "object"}}, "$ref": "#/$defs/n", "required": ["a"]}
    assert merged_sibling_refs(top) is top
    assert merged_sibling_refs({"type": "string"}) == {"type": "string"}
    assert merged_sibling_refs(plain) is not plain  # NODE's own sibling ref is merged


# an anyOf of refs with a sibling `type` (JSONSchemaBench Github_medium o72177's shape) and a
# root's properties beside a oneOf of refs that recurse to the root (o75099's shape)
SPEC = {"type": "object", "anyOf": [{"$ref": "#/definitions/pair"}, {"$ref": "#/definitions/leaf"}]}
TRANSFORMS = {
    "type": "object",
    "anyOf": [{"$ref": "#/definitions/pair"}, {"$ref": "#/definitions/leaf"}],
    "definitions": {
        "spec": SPEC,
        "pair": {
            "type": "object",
            "properties": {
                "a": {"$ref": "#/definitions/spec"},
                "b": {"$ref": "#/definitions/spec"},
            },
            "required": ["a", "b"],
        },
        "leaf": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
            "additionalProperties": False,
        },
    },
}
GEOMETRY = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"type": "string"}, "crs": {"type": "integer"}},
    "oneOf": [{"$ref": "#/definitions/collection"}, {"$ref": "#/definitions/point"}],
    "definitions": {
        "collection": {
            "required": ["geometries"],
            "properties": {
                "type": {"enum": ["GeometryCollection"]},
                "geometries": {"type": "array", "items": {"$ref": "#"}},
            },
        },
        "point": {
            "required": ["coordinates"],
            "properties": {
                "type": {"enum": ["Point"]},
                "coordinates": {"type": "array", "items": {"type": "number"}},
            },
        },
    },
}
SHAPE_DOCS = [
    {"name": "x"},
    {"a": {"name": "x"}, "b": {"a": {"name": "y"}, "b": {"name": "z"}}},
    {"a": {"name": "x"}},
    {"a": {"name": 1}, "b": {"name": "z"}},
    {"name": "x", "extra": 1},
    {"type": "Point", "coordinates": [1, 2]},
    {"type": "GeometryCollection", "geometries": [{"type": "Point", "coordinates": []}]},
    {"type": "GeometryCollection", "geometries": [{"type": "Line", "coordinates": []}]},
    {"type": "Point", "coordinates": [1], "crs": 2},
    {"type": "Point", "coordinates": [1], "crs": "x"},
    {"type": "Point"},
]


@pytest.mark.parametrize(
    ("schema", "strict"), [(TRANSFORMS, True), (GEOMETRY, False)], ids=["anyOf+type", "oneOf+root"]
)
def test_ref_branches_with_siblings_compile_exactly(schema: Any, strict: bool) -> None:
    """(oneOf's exclusivity is no grammar's: lenient, reported, and no document here is valid
    under two branches)"""
    error = llguidance.LLMatcher.validate_grammar(
        json.dumps({"grammars": [{"json_schema": schema}]})
    )
    assert "circular references with sibling keys" in error  # the library alone
    grammar = backend("llguidance", strict=strict).compile(GrammarSpec.json_schema(schema))
    assert set(grammar.unenforced) <= ({"oneOf"} if not strict else set())
    validator = jsonschema.Draft202012Validator(schema)
    valid = 0
    for doc in SHAPE_DOCS:
        expected = validator.is_valid(doc)
        for text in (json.dumps(doc), json.dumps(doc, separators=(",", ":"))):
            assert walk(grammar.matcher(), encode(text)).accepted == expected, (doc, text)
        valid += expected
    assert valid >= 2


@pytest.mark.parametrize(
    ("mine", "theirs", "joined"),
    [
        ("object", "object", "object"),
        (["string", "null"], "string", "string"),
        ("number", "integer", "integer"),
        (["integer", "string"], ["number", "null"], "integer"),
        ("string", "object", None),
    ],
)
def test_types_join(mine: Any, theirs: Any, joined: Any) -> None:
    from weft.constrain.schema_refs import _joined

    assert _joined("type", mine, theirs) == joined

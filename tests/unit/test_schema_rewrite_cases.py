"""Shared cases for the exact schema rewrites (constrain/schema_rewrites.py): one schema per
rewrite, an instance strategy that reaches their edges, and jsonschema with ECMA-262's `$`."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import jsonschema
from hypothesis import strategies as st

from weft.constrain.schema import walk

# (rewrite, schema): each is rewritten, and none keeps the rewritten keyword
CASES: list[tuple[str, Any]] = [
    ("not-types", {"not": {"type": ["string", "null"]}}),
    ("not-required", {"type": "object", "not": {"required": ["a", "b"]}}),
    ("not-properties", {"not": {"properties": {"a": {"minimum": 3}}, "required": ["a"]}}),
    ("not-enum", {"not": {"enum": ["a", "ab", "a\n", 1, 2.5, True, None]}}),
    ("not-anyOf", {"not": {"anyOf": [{"maxLength": 1}, {"type": "array", "minItems": 2}]}}),
    ("not-prefixItems", {"not": {"prefixItems": [{"const": 1}], "items": False}}),
    ("not-counts", {"not": {"minProperties": 1, "maxProperties": 2}}),
    ("not-not", {"not": {"not": {"type": "string", "pattern": "^a"}}}),
    ("not-false", {"properties": {"a": {"not": {}}, "b": {"not": False}}}),
    (
        "if-then-else",
        {
            "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
            "then": {"required": ["b"]},
            "else": {"maxProperties": 1},
        },
    ),
    ("if-then", {"if": {"type": "string"}, "then": {"minLength": 2}}),
    ("if-else", {"if": {"minimum": 0}, "else": {"multipleOf": 2}}),
    ("if-alone", {"if": {"const": 0}, "type": "integer"}),
    ("then-alone", {"then": False, "else": False}),
    ("dependentRequired", {"dependentRequired": {"a": ["b", "x"], "b": []}}),
    (
        "dependentSchemas",
        {
            "dependentSchemas": {
                "a": {"properties": {"b": {"type": "string"}}},
                "x": False,
                "b": True,
            }
        },
    ),
    (
        "propertyNames-enum",
        {"propertyNames": {"enum": ["a", "b"]}, "properties": {"a": {"type": "integer"}}},
    ),
    (
        "propertyNames-length",
        {"propertyNames": {"maxLength": 1}, "additionalProperties": {"type": "number"}},
    ),
    ("propertyNames-pattern", {"propertyNames": {"type": "string", "pattern": "^a"}}),
    ("propertyNames-false", {"propertyNames": False}),
    ("propertyNames-type", {"propertyNames": {"type": "number"}}),
    ("contains-true", {"contains": True, "minContains": 2, "maxContains": 3}),
    ("contains-none", {"contains": {"type": "string"}, "maxContains": 0, "minContains": 0}),
    ("contains-empty", {"contains": {"const": 1}, "minContains": 3, "maxContains": 1}),
    ("contains-false", {"contains": False}),
    ("contains-zero", {"contains": {"const": 1}, "minContains": 0}),
    ("minContains-alone", {"minContains": 2, "maxContains": 0}),
    (
        "uniqueItems-tuple",
        {
            "prefixItems": [{"type": "boolean"}, {"enum": [True, None, 1]}],
            "items": False,
            "uniqueItems": True,
        },
    ),
    ("uniqueItems-enum", {"items": {"enum": [1, 1.0, "a"]}, "maxItems": 3, "uniqueItems": True}),
    ("uniqueItems-short", {"maxItems": 1, "uniqueItems": True}),
    ("uniqueItems-false", {"uniqueItems": False}),
    ("oneOf-types", {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "array"}]}),
    (
        "oneOf-tags",
        {
            "type": "object",
            "oneOf": [
                {"properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"properties": {"k": {"enum": ["b", 1]}}, "required": ["k"]},
            ],
        },
    ),
    (
        "oneOf-forbidden",
        {
            "oneOf": [
                {"type": "object", "properties": {"a": True}, "required": ["a"]},
                {"properties": {"b": True}, "additionalProperties": False},
            ]
        },
    ),
    ("oneOf-lengths", {"type": "string", "oneOf": [{"minLength": 2}, {"maxLength": 3}]}),
    ("oneOf-complements", {"oneOf": [{"required": ["a"]}, {"required": ["b"]}, {"type": "array"}]}),
    (
        "unevaluatedProperties",
        {
            "properties": {"a": True},
            "allOf": [{"patternProperties": {"^b": {"type": "string"}}}],
            "unevaluatedProperties": {"type": "integer"},
        },
    ),
    (
        "unevaluatedItems",
        {
            "prefixItems": [True],
            "allOf": [{"prefixItems": [True, {"type": "string"}]}],
            "unevaluatedItems": False,
        },
    ),
    (
        "unevaluated-ref",
        {
            "$defs": {"d": {"properties": {"b": True}}},
            "$ref": "#/$defs/d",
            "unevaluatedProperties": False,
        },
    ),
    (
        "unevaluated-nested",
        {
            "allOf": [{"properties": {"a": True}, "unevaluatedProperties": True}],
            "unevaluatedProperties": False,
        },
    ),
    (
        "unevaluated-not",
        {
            "prefixItems": [{"const": 1}],
            "not": {"not": {"prefixItems": [True, {"const": 2}]}},
            "unevaluatedItems": False,
        },
    ),
    (
        "unevaluated-anyOf",
        {
            "properties": {"a": True},
            "anyOf": [
                {"properties": {"b": {"const": 1}}, "required": ["b"]},
                {"properties": {"k": True}, "required": ["x"]},
            ],
            "unevaluatedProperties": {"type": "string"},
        },
    ),
    (
        "unevaluated-oneOf",
        {
            "prefixItems": [True],
            "oneOf": [
                {"prefixItems": [True, {"type": "string"}]},
                {"prefixItems": [{"type": "number"}], "items": False},
            ],
            "unevaluatedItems": False,
        },
    ),
    (
        "unevaluated-if",
        {
            "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
            "then": {"properties": {"b": True}},
            "else": {"patternProperties": {"^k": True}},
            "unevaluatedProperties": False,
        },
    ),
    (
        "unevaluated-dependentSchemas",
        {
            "properties": {"a": True},
            "dependentSchemas": {"a": {"properties": {"b": True}}},
            "unevaluatedProperties": False,
        },
    ),
    (
        "dynamicRef-anchor",
        {"$defs": {"n": {"$dynamicAnchor": "n", "type": "string"}}, "items": {"$dynamicRef": "#n"}},
    ),
    (
        "dynamicRef-pointer",
        {"$defs": {"n": {"maxLength": 2}}, "items": {"$dynamicRef": "#/$defs/n"}},
    ),
    ("const-object", {"const": {"a": 1, "b": [2.0, "x"]}}),
    ("enum-numbers", {"enum": [0, -3, 2.5, "s", {"k": 1}]}),
]
# left as written: what they read depends on the instance, or a $ref points into them
KEPT: list[Any] = [
    {"anyOf": [{"properties": {"a": {"type": "integer"}}}], "unevaluatedProperties": False},
    {"not": {"type": "integer"}},
    {"oneOf": [{"type": "integer"}, {"minimum": 2}]},
    {
        "$defs": {"a": {"$ref": "#/not"}},
        "not": {"type": "string"},
        "properties": {"x": {"$ref": "#/$defs/a"}},
    },
    {"$schema": "http://json-schema.org/draft-07/schema#", "dependentRequired": {"a": ["b"]}},
    {"contains": {"const": 1}, "minContains": 2},
    {"items": {"type": "integer"}, "uniqueItems": True},
    {"propertyNames": {"pattern": "^a", "maxLength": 3}},
    {
        "$defs": {
            "a": {"$dynamicAnchor": "n", "type": "string"},
            "b": {"$id": "b", "$dynamicAnchor": "n"},
        },
        "items": {"$dynamicRef": "#n"},
    },
]
NAMES = ["a", "b", "k", "x", "aa", "ba"]
STRINGS = ["", "a", "b", "ab", "a\n", "abcd", "s", "x"]
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-4, 4)
    | st.sampled_from([-3, 0.0, 1.0, 2.0, 2.5, -0.5, 6])
    | st.sampled_from(STRINGS)
)
INSTANCES = st.recursive(
    _SCALARS,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.sampled_from(NAMES), kids, max_size=3)
    ),
    max_leaves=8,
)


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    """`pattern` read as ECMA-262 reads `$` (the end, never before a final newline)."""
    if not validator.is_type(instance, "string"):
        return
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"
    if not re.search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": _pattern})


@functools.lru_cache(maxsize=512)
def _validator(text: str) -> Any:
    return _Validator(json.loads(text))


def is_valid(schema: Any, instance: Any) -> bool:
    return bool(_validator(json.dumps(schema)).is_valid(instance))


def keywords(schema: Any) -> set[str]:
    return {key for node in walk(schema) for key in node}

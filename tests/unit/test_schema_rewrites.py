"""The exact schema rewrites (constrain/schema_rewrites.py and the modules it calls) keep every
instance's verdict: checked with jsonschema on the schema as written and as rewritten, over the
cases of test_schema_rewrite_cases.py and over random schemas and instances (hypothesis)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_schema_rewrite_cases import CASES, INSTANCES, KEPT, NAMES, STRINGS, is_valid, keywords

from weft.constrain.schema_negate import TYPES, excluding_strings, negate
from weft.constrain.schema_rewrites import REWRITTEN, exact_rewrites
from weft.constrain.schema_sets import disjoint, unique_arrays
from weft.constrain.schema_spellings import value_schema

EXAMPLES = settings(max_examples=150, deadline=None)
# cases whose keywords ask nothing: every instance is valid
ALWAYS = (
    "then-alone",
    "minContains-alone",
    "uniqueItems-false",
    "contains-zero",
    "unevaluated-nested",
)


@pytest.mark.parametrize("schema", [s for _, s in CASES], ids=[n for n, _ in CASES])
def test_each_case_is_rewritten_away(schema: Any) -> None:
    before = copy.deepcopy(schema)
    out = exact_rewrites(schema)
    assert schema == before  # the input is never changed
    left = keywords(out) & (REWRITTEN | {"$dynamicRef", "$dynamicAnchor"})
    assert out != schema and not left, (out, left)


@pytest.mark.parametrize("schema", KEPT, ids=range(len(KEPT)))
def test_what_is_not_exact_is_kept(schema: Any) -> None:
    out = exact_rewrites(schema)
    assert keywords(out) & REWRITTEN == keywords(schema) & REWRITTEN, out


@EXAMPLES
@pytest.mark.parametrize("schema", [s for _, s in CASES], ids=[n for n, _ in CASES])
@given(instance=INSTANCES)
def test_rewrites_keep_every_verdict(schema: Any, instance: Any) -> None:
    assert is_valid(exact_rewrites(schema), instance) == is_valid(schema, instance)


@pytest.mark.parametrize("name,schema", CASES, ids=[n for n, _ in CASES])
def test_the_cases_reach_both_verdicts(name: str, schema: Any) -> None:
    """The instance strategy is not vacuous: hand-picked instances of both verdicts agree too."""
    picks = [
        None,
        0,
        1,
        2.5,
        "",
        "ab",
        [],
        [1],
        [1, 1],
        [True, None],
        {},
        {"a": 1},
        {"a": 1, "b": 2},
    ]
    picks += [{"b": "s"}, {"a": 1, "b": "x", "x": 1}, ["a", "b"], [1, "a"], {"k": "a"}, {"k": 1}]
    picks += [-1, "a\n", {"aa": 1}, {"b": 1}, [1, 2, 3], [True, False], {"a": 3}, {"a": "x"}]
    picks += [["abcd"], {"a": 1, "b": [2, "x"]}]
    rewritten = exact_rewrites(schema)
    verdicts = {is_valid(schema, p) for p in picks}
    for p in picks:
        assert is_valid(rewritten, p) == is_valid(schema, p), (name, p)
    assert verdicts == {True, False} or name in ALWAYS


##### Random schemas #####

_NUMBERS = st.integers(-3, 3) | st.sampled_from([0.5, 2.5, 2.0])
_VALUES = st.none() | st.booleans() | _NUMBERS | st.sampled_from(STRINGS)
_LEAVES = st.one_of(
    st.booleans(),
    st.builds(lambda t: {"type": t}, st.sampled_from([*TYPES, "integer"])),
    st.builds(
        lambda t: {"type": t}, st.lists(st.sampled_from(TYPES), min_size=1, max_size=3, unique=True)
    ),
    st.builds(lambda v: {"const": v}, _VALUES),
    st.builds(lambda vs: {"enum": vs}, st.lists(_VALUES, min_size=1, max_size=4)),
    st.builds(
        lambda k, v: {k: v},
        st.sampled_from(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]),
        _NUMBERS,
    ),
    st.builds(
        lambda k, n: {k: n},
        st.sampled_from(
            ["minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"]
        ),
        st.integers(0, 3),
    ),
    st.builds(
        lambda r: {"required": r}, st.lists(st.sampled_from(NAMES[:3]), max_size=2, unique=True)
    ),
    st.just({"additionalProperties": False}),
    st.builds(lambda u: {"uniqueItems": u}, st.booleans()),
    st.builds(lambda p: {"pattern": p}, st.sampled_from(["^a", "b$", "^a\n?$"])),
)


def _nodes(kids: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    names = st.sampled_from(NAMES[:3])
    return st.one_of(
        st.builds(lambda d: {"properties": d}, st.dictionaries(names, kids, max_size=2)),
        st.builds(lambda p: {"prefixItems": p}, st.lists(kids, max_size=2)),
        st.builds(lambda i: {"items": i}, kids),
        st.builds(
            lambda k, v: {k: v},
            st.sampled_from(["allOf", "anyOf", "oneOf"]),
            st.lists(kids, min_size=1, max_size=3),
        ),
        st.builds(lambda s: {"not": s}, kids),
        st.builds(lambda c, t, e: {"if": c, "then": t, "else": e}, kids, kids, kids),
        st.builds(lambda c, t: {"if": c, "then": t}, kids, kids),
        st.builds(lambda d: {"dependentSchemas": d}, st.dictionaries(names, kids, max_size=2)),
        st.builds(
            lambda d: {"dependentRequired": d},
            st.dictionaries(names, st.lists(names, max_size=2), max_size=2),
        ),
        st.builds(lambda s: {"propertyNames": s}, kids),
        st.builds(
            lambda k, v: {k: v},
            st.sampled_from(["unevaluatedProperties", "unevaluatedItems"]),
            kids,
        ),
        st.builds(
            lambda c, lo, hi: {"contains": c, "minContains": lo, "maxContains": hi},
            kids,
            st.integers(0, 2),
            st.integers(0, 2),
        ),
        st.builds(
            lambda a, b: {**a, **b},
            kids.filter(lambda k: isinstance(k, dict)),
            kids.filter(lambda k: isinstance(k, dict)),
        ),
    )


SCHEMAS = st.recursive(_LEAVES, _nodes, max_leaves=6)


@settings(max_examples=400, deadline=None)
@given(schema=SCHEMAS, instances=st.lists(INSTANCES, min_size=4, max_size=4))
def test_random_schemas_keep_every_verdict(schema: Any, instances: list[Any]) -> None:
    out = exact_rewrites(schema)
    for instance in instances:
        assert is_valid(out, instance) == is_valid(schema, instance), (json.dumps(out), instance)


@settings(max_examples=400, deadline=None)
@given(schema=SCHEMAS, instances=st.lists(INSTANCES, min_size=4, max_size=4))
def test_complements_are_exact(schema: Any, instances: list[Any]) -> None:
    inverse = negate(schema)
    if inverse is None:
        return
    for instance in instances:
        assert is_valid(inverse, instance) != is_valid(schema, instance), (inverse, instance)


def test_what_has_no_known_complement() -> None:
    for schema in (
        {"type": "integer"},
        {"pattern": "a"},
        {"multipleOf": 2},
        {"$ref": "#"},
        {"$id": "x", "type": "string"},
        {"anyOf": [{"type": "string"}, {"format": "email"}]},
    ):
        assert negate(schema) is None, schema
    assert negate({}) is False and negate(False) is True


@settings(max_examples=300, deadline=None)
@given(
    words=st.lists(st.text('ab\n"\\é😀', max_size=3), max_size=4),
    text=st.text('ab\n"\\é😀', max_size=4),
)
def test_excluding_strings(words: list[str], text: str) -> None:
    schema = {"type": "string", "pattern": excluding_strings(words)}
    assert is_valid(schema, text) == (text not in words)


@settings(max_examples=300, deadline=None)
@given(value=INSTANCES, other=INSTANCES)
def test_value_schemas_hold_exactly_their_value(value: Any, other: Any) -> None:
    schema = value_schema(value)
    assert is_valid(schema, value)
    assert is_valid(schema, other) == is_valid({"const": value}, other)


def test_disjoint_branches() -> None:
    assert disjoint([{"type": "string"}, {"type": ["integer", "null"]}])
    assert not disjoint([{"type": "integer"}, {"type": "number"}])
    tagged = [
        {"properties": {"k": {"const": 1}}, "required": ["k"]},
        {"properties": {"k": {"const": 1.0}}, "required": ["k"]},
    ]
    assert not disjoint(tagged, "object")  # 1 and 1.0 are one value
    tagged[1]["properties"]["k"] = {"const": 2}
    assert disjoint(tagged, "object") and not disjoint(tagged)  # a string satisfies both


def test_unique_arrays_enumerate_only_finite_items() -> None:
    arrays = unique_arrays(
        {"prefixItems": [{"type": "boolean"}], "items": {"enum": [1, 1.0]}, "maxItems": 3}
    )
    assert arrays == [[], [False], [True], [False, 1], [True, 1]]
    assert unique_arrays({"items": {"type": "string"}, "maxItems": 2}) is None
    assert unique_arrays({"items": {"type": "boolean"}}) is None  # no bound on the length

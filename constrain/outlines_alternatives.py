"""Alternatives in the outlines schema rewrite (outlines_schema.py): listed values as outlines-core
schemas, repeats dropped, and whether `oneOf` entries' alternatives can overlap."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from weft.constrain.errors import GrammarError
from weft.constrain.outlines_containers import closed_object, one_of, spellable

MAX_ALTERNATIVES = 256  # alternatives of one subschema


##### Public API #####


def value_schemas(value: Any, where: str) -> list[Any]:
    """The alternatives that write exactly `value` (an integral float also as an integer)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return [{"const": int(value)}, {"const": value}]
    if isinstance(value, list):
        if not value:
            return [{"type": "array", "maxItems": 0}]
        return [{"prefixItems": [one_of(value_schemas(v, where)) for v in value]}]
    if isinstance(value, dict):
        if not all(spellable(k) for k in value):
            raise GrammarError(
                f"the outlines backend cannot write a property name of a listed value (at #{where})"
            )
        props = {k: one_of(value_schemas(v, where)) for k, v in value.items()}
        return [closed_object(props, list(value))]
    return [{"const": value}]


def distinct(alternatives: list[Any]) -> list[Any]:
    """`alternatives` without repeats (GrammarError past MAX_ALTERNATIVES)."""
    seen: dict[str, Any] = {}
    for a in alternatives:
        seen.setdefault(json.dumps(a, sort_keys=True), a)
    if len(seen) > MAX_ALTERNATIVES:
        raise GrammarError(
            "json_schema is too complex for the outlines backend "
            f"(over {MAX_ALTERNATIVES} alternatives in one place)"
        )
    return list(seen.values())


def disjoint(branches: list[Branch]) -> bool:
    """Whether no value matches two of a oneOf's entries (so their alternatives' union is exact).
    Listed values (consts) were validated against the whole oneOf; an entry's other alternatives
    must miss every value of the other entries: by type (the types those entries allow, listed
    values that were dropped included), else by their forms (array lengths, a required property
    that the other object cannot hold)."""
    for i, left in enumerate(branches):
        for right in branches[i + 1 :]:
            if _meet(left, right) or _meet(right, left):
                return False
    return True


@dataclass(frozen=True)
class Branch:
    """A oneOf entry rewritten: its alternatives, the types its values may have, whether its
    values are listed (enum / const: every alternative is one)."""

    alternatives: list[Any]
    kinds: frozenset[str]
    listed: bool


##### Internal Helper Functions #####


def _meet(left: Branch, right: Branch) -> bool:
    """Whether an alternative of `left` that is not a listed value may write a value `right`
    matches."""
    for a in left.alternatives:
        kind = _kind(a)
        if "const" in a:
            continue
        if kind is None or not (_same_types({kind}) & _same_types(right.kinds)):
            if kind is None:
                return True
            continue
        if right.listed:
            return True
        same = [
            b for b in right.alternatives if _same_types({_kind(b) or ""}) & _same_types({kind})
        ]
        if any("const" in b or _may_overlap(a, b) for b in same) or not same:
            return True
    return False


def _same_types(kinds: frozenset[str] | set[str]) -> set[str]:
    """`kinds` with integer and number standing for each other (they share values)."""
    return set(kinds) | ({"integer", "number"} if {"integer", "number"} & set(kinds) else set())


def _may_overlap(a: Any, b: Any) -> bool:
    ka, kb = _kind(a), _kind(b)
    if ka is None or kb is None:
        return True
    if {ka, kb} <= {"integer", "number"}:
        return True
    if ka != kb:
        return False
    if ka == "array":
        return _lengths(a)[0] <= _lengths(b)[1] and _lengths(b)[0] <= _lengths(a)[1]
    if ka == "object" and "properties" in a and "properties" in b:
        return not (_excludes(a, b) or _excludes(b, a))
    return True


def _kind(a: Any) -> str | None:
    if "prefixItems" in a:
        return "array"
    kind = a.get("type")
    return kind if isinstance(kind, str) else None


def _lengths(a: Any) -> tuple[float, float]:
    if "prefixItems" in a:
        return len(a["prefixItems"]), len(a["prefixItems"])
    return a.get("minItems", 0), a.get("maxItems", math.inf)


def _excludes(a: Any, b: Any) -> bool:
    """Whether closed object `a` requires what closed object `b` cannot hold: a property `b` does
    not declare, or a listed value `b` never lists there."""
    for name in a["required"]:
        if name not in b["properties"]:
            return True
        left, right = _listed(a["properties"][name]), _listed(b["properties"][name])
        if left is not None and right is not None and not (left & right):
            return True
    return False


def _listed(schema: Any) -> set[str] | None:
    alternatives = schema["anyOf"] if "anyOf" in schema else [schema]
    if all("const" in a for a in alternatives):
        return {json.dumps(a["const"]) for a in alternatives}
    return None

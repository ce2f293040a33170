"""What a schema's instances are, where that is cheap to know: the JSON types it allows, the values
of a finite schema, whether `oneOf` branches can overlap, and the unique arrays over finite items."""

from __future__ import annotations

import itertools
import json
from typing import Any

from weft.constrain.schema import ANNOTATIONS

MAX_ARRAYS = 64  # unique arrays enumerated for a `uniqueItems` at most
MAX_CANDIDATES = 4096  # arrays looked at to find them
MAX_LENGTH = 16  # the longest array enumerated


def json_types(schema: Any) -> frozenset[str] | None:
    """The JSON types `schema` allows (`number` holds integers), None for all of them."""
    if schema is False:
        return frozenset()
    if not isinstance(schema, dict):
        return None
    found: frozenset[str] | None = None
    kinds = schema.get("type")
    if isinstance(kinds, str | list):
        names = [kinds] if isinstance(kinds, str) else kinds
        found = frozenset("number" if n == "integer" else n for n in names if isinstance(n, str))
    if "const" in schema or isinstance(schema.get("enum"), list):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        of_values = frozenset(kind_of(v) for v in values)
        found = of_values if found is None else found & of_values
    return found


def kind_of(value: Any) -> str:
    """The JSON type of a JSON value (`number` for integers)."""
    kind = json_type(value)
    return "number" if kind == "integer" else kind


def json_type(value: Any) -> str:
    """The JSON Schema type of a JSON value ("integer" for integral numbers)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def canonical(value: Any) -> str:
    """A text equal for JSON-equal values (1 and 1.0; objects in any key order)."""
    return json.dumps(integral(value), sort_keys=True)


def disjoint(branches: list[Any], context: Any = None) -> bool:
    """Whether no instance satisfies two of `branches` (so `oneOf` is `anyOf`), by sufficient
    tests per pair: types that do not meet (within the parent's `type`), or an object property
    that both require with disjoint `const`/`enum` values, or that one requires and the other
    forbids."""
    outer = json_types({"type": context}) if context is not None else None
    types = [json_types(b) for b in branches]
    for i, j in itertools.combinations(range(len(branches)), 2):
        common = _meet(_meet(outer, types[i]), types[j])
        if common is not None and not common:
            continue
        if common is not None and common <= {"object"}:
            if _exclusive(branches[i], branches[j]) or _exclusive(branches[j], branches[i]):
                continue
        return False
    return True


def finite_values(schema: Any) -> list[Any] | None:
    """Every value `schema` allows, if it is a small finite set stated by `const`, `enum` and
    `type` (booleans, null) alone; None otherwise."""
    if schema is False:
        return []
    if not isinstance(schema, dict):
        return None
    keys = {k for k in schema if k not in ANNOTATIONS and not k.startswith("x-")}
    if not keys <= {"type", "const", "enum"}:
        return None
    if "const" in schema:
        values = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        values = list(schema["enum"])
    else:
        kinds = json_types(schema)
        if kinds is None or not kinds <= {"boolean", "null"}:
            return None
        values = [v for v in (None, False, True) if kind_of(v) in kinds]
    if "enum" in schema and "const" in schema:
        allowed = (
            {canonical(v) for v in schema["enum"]} if isinstance(schema["enum"], list) else set()
        )
        values = [v for v in values if canonical(v) in allowed]
    if "type" in schema:
        values = [v for v in values if _has_type(v, schema["type"])]
    return list({canonical(v): v for v in values}.values())


def unique_arrays(schema: dict[str, Any]) -> list[list[Any]] | None:
    """The arrays `schema`'s array keywords allow that have no two equal items, if their items
    are finite (finite_values) and their length bounded; None otherwise or if there are many."""
    prefix = schema.get("prefixItems", [])
    rest = schema.get("items", True)
    low, high = schema.get("minItems", 0), schema.get("maxItems")
    if not isinstance(prefix, list) or not isinstance(low, int):
        return None
    if rest is False:
        high = len(prefix) if high is None else min(high, len(prefix))
    if not isinstance(high, int) or isinstance(high, bool) or high > MAX_LENGTH:
        return None
    domains = [finite_values(prefix[i] if i < len(prefix) else rest) for i in range(high)]
    out: list[list[Any]] = []
    looked = 0
    for length in range(max(low, 0), high + 1):
        if any(d is None for d in domains[:length]):
            return None
        for items in itertools.product(*(d or [] for d in domains[:length])):
            looked += 1
            if looked > MAX_CANDIDATES:
                return None
            if len({canonical(v) for v in items}) == length:
                out.append(list(items))
                if len(out) > MAX_ARRAYS:
                    return None
    return out


##### Internal Helper Functions #####


def integral(value: Any) -> Any:
    """`value` with integral floats as ints (1.0 as 1), the spelling `canonical` compares."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [integral(v) for v in value]
    if isinstance(value, dict):
        return {k: integral(v) for k, v in value.items()}
    return value


def _meet(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    if a is None:
        return b
    return a if b is None else a & b


def _has_type(value: Any, kinds: Any) -> bool:
    names = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    kind = kind_of(value)
    if kind in names:
        return True
    integral = isinstance(value, int) or isinstance(value, float) and value.is_integer()
    return "integer" in names and kind == "number" and integral


def _exclusive(first: Any, second: Any) -> bool:
    """Whether no object satisfies both: a property `first` requires that `second` forbids, or
    that both require with disjoint `const`/`enum` values."""
    if not isinstance(first, dict) or not isinstance(second, dict):
        return False
    required = first.get("required", [])
    if not isinstance(required, list):
        return False
    for name in required:
        if not isinstance(name, str):
            continue
        if _forbids(second, name):
            return True
        other = second.get("required", [])
        mine, theirs = _values_of(first, name), _values_of(second, name)
        if isinstance(other, list) and name in other and mine is not None and theirs is not None:
            if not mine & theirs:
                return True
    return False


def _forbids(schema: dict[str, Any], name: str) -> bool:
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        return False
    if props.get(name, None) is False:
        return True
    return (
        schema.get("additionalProperties") is False
        and name not in props
        and not schema.get("patternProperties")
    )


def _values_of(schema: dict[str, Any], name: str) -> set[str] | None:
    props = schema.get("properties", {})
    sub = props.get(name) if isinstance(props, dict) else None
    if not isinstance(sub, dict):
        return None
    if "const" in sub:
        return {canonical(sub["const"])}
    if isinstance(sub.get("enum"), list):
        return {canonical(v) for v in sub["enum"]}
    return None

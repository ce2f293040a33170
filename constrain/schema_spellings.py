"""`const` / `enum` values rewritten so that the grammar takes each of their JSON spellings that
json.dumps writes, not only the library's one.

llguidance writes a const's integral number one way (`1`, never `1.0`, which equals it) and an
object's keys in one order. Such a value becomes the schema of exactly that value, in keywords the
library reads with more spellings:

- an integral number c: `{"type": "number", "minimum": c, "maximum": c + 0.4, "multipleOf": 0.5}`
  (for c < 0 the range is [c - 0.4, c]): c is the only multiple of 0.5 there, and the library
  writes it as `c` and `c.0`;
- an array: `prefixItems` of its items' schemas, with its length as `minItems` = `maxItems`;
- an object: `properties` of its values' schemas, all `required`, `additionalProperties: false`;
  with 2 to MAX_ORDERED keys, an `anyOf` of that in each order of its keys.

Other values (strings, booleans, null, other numbers) stay `const` / `enum` entries, and so does
an `enum` with more than MAX_VALUES values to respell (the grammar grows with each).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from weft.constrain.schema import walk
from weft.constrain.schema_negate import Schema, any_of

MAX_SPELLED = 2**31  # integral numbers respelled (their ranges stay exact in the library's f64)
MAX_ORDERED = 3  # keys of an object value written in every order (3! = 6 branches)
MAX_TEXT = 20_000  # characters of one respelled value's schema at most
MAX_VALUES = 16  # respelled values of one `enum` at most (each costs the compile ~0.05 ms)


def respelled(schema: Any) -> Any:
    """`schema` (rewritten in place) with each `const` / `enum` value that has another spelling
    rewritten as the module doc says."""
    for node in walk(schema):
        if not isinstance(node.get("allOf", []), list):
            continue
        conjunct: Schema | None = None
        if "const" in node and _needs(node["const"]):
            conjunct = _bounded(value_schema(node["const"]))
            if conjunct is not None:
                del node["const"]
        elif isinstance(node.get("enum"), list) and 0 < _count_needing(node["enum"]) <= MAX_VALUES:
            conjunct = _enum_schema(node["enum"])
            if conjunct is not None:
                del node["enum"]
        if conjunct is not None:
            node.setdefault("allOf", []).append(conjunct)
    return schema


def needs_respelling(node: dict[str, Any]) -> bool:
    """Whether `node`'s `const` / `enum` is rewritten here (a value the library would write in
    one spelling only, and not too many of them)."""
    if "const" in node and _needs(node["const"]):
        return True
    values = node.get("enum")
    return isinstance(values, list) and 0 < _count_needing(values) <= MAX_VALUES


def value_schema(value: Any) -> Schema:
    """The schema of exactly `value` (by JSON equality), as the module doc writes it."""
    if not _needs(value):
        return {"const": value}
    if isinstance(value, int | float):
        c = int(value)
        low, high = (c, c + 0.4) if c >= 0 else (c - 0.4, c)
        return {"type": "number", "minimum": low, "maximum": high, "multipleOf": 0.5}
    if isinstance(value, list):
        items = [value_schema(v) for v in value]
        shape: dict[str, Any] = {"type": "array", "maxItems": len(items)}
        return {**shape, "prefixItems": items, "minItems": len(items)} if items else shape
    assert isinstance(value, dict)
    subs = {k: value_schema(v) for k, v in value.items()}
    orders = itertools.permutations(subs) if 2 <= len(subs) <= MAX_ORDERED else [tuple(subs)]
    return any_of(
        [
            {
                "type": "object",
                "properties": {k: subs[k] for k in order},
                "required": list(order),
                "additionalProperties": False,
            }
            for order in orders
        ]
    )


##### Internal Helper Functions #####


def _needs(value: Any) -> bool:
    """Whether `value` has a spelling the library's const would not take."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) <= MAX_SPELLED
    if isinstance(value, float):
        return value.is_integer() and abs(value) <= MAX_SPELLED
    if isinstance(value, list):
        return any(map(_needs, value))
    if isinstance(value, dict):
        return len(value) >= 2 or any(map(_needs, value.values()))
    return False


def _bounded(schema: Schema) -> Schema | None:
    return schema if len(json.dumps(schema)) <= MAX_TEXT else None


def _count_needing(values: list[Any]) -> int:
    """How many of `values` need respelling, counted up to MAX_VALUES + 1."""
    needing = (v for v in values if not isinstance(v, str) and _needs(v))
    return sum(1 for _ in itertools.islice(needing, MAX_VALUES + 1))


def _enum_schema(values: list[Any]) -> Schema | None:
    spelled = [_bounded(value_schema(v)) for v in values if _needs(v)]
    if any(s is None for s in spelled):
        return None
    rest = [v for v in values if not _needs(v)]
    return any_of([s for s in spelled if s is not None] + ([{"enum": rest}] if rest else []))

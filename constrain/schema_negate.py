"""Exact complements of JSON schemas (draft 2020-12), written in keywords llguidance enforces.

`negate(s)` is a schema that an instance satisfies exactly when it does not satisfy `s`, or None
where no such schema is known. `not (k1 and k2 ...)` is `(not k1) or (not k2) ...`; each keyword
that applies to one JSON type is violated only by instances of that type, so its complement is
that type with the opposite bound (`minimum: m` -> a number below m). Keywords without an exact
complement here give None: `pattern`, `format`, `multipleOf`, `contains`, `uniqueItems`, a `$ref`,
and `type: integer` without `number` (its complement holds 1.5 but not 1.0, which no number
grammar of the library tells apart).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

from weft.constrain.schema import ANNOTATIONS, walk
from weft.constrain.schema_sets import kind_of

Schema = dict[str, Any] | bool
TYPES = ("null", "boolean", "object", "array", "number", "string")
ANY_CHAR = "(?s:.)"
IDENTITY = ("$id", "$anchor", "$dynamicAnchor")
MAX_EXACT_NUMBER = 2**53  # numbers compared exactly as the library's f64 bounds
# NOTE: `$id` and `$anchor` name a subschema that a `$ref` may reach: not skipped, so refused
_SKIPPED = (ANNOTATIONS - {"$id", "$anchor"}) | {"$schema", "$defs", "definitions"}


def negate(schema: Any) -> Schema | None:
    """A schema for exactly the instances `schema` rejects; None if there is none known (or if
    `schema` names a subschema, which a `$ref` could no longer reach)."""
    if has_identity(schema):
        return None
    return _negate(schema)


def has_identity(schema: Any) -> bool:
    """Whether a subschema of `schema` has an `$id` or an anchor (a `$ref` may reach it)."""
    return any(key in node for node in walk(schema) for key in IDENTITY)


def any_of(branches: list[Schema]) -> Schema:
    """`anyOf` of `branches`, simplified: false ones dropped, true if one is true."""
    kept = [b for b in branches if b is not False]
    if any(b is True or b == {} for b in kept):
        return True
    if not kept:
        return False
    return kept[0] if len(kept) == 1 else {"anyOf": kept}


def all_of(parts: list[Schema]) -> Schema:
    """`allOf` of `parts`, simplified: true ones dropped, false if one is false."""
    kept = [p for p in parts if p is not True and p != {}]
    if any(p is False for p in kept):
        return False
    if not kept:
        return True
    return kept[0] if len(kept) == 1 else {"allOf": kept}


def other_types(*names: str) -> list[Schema]:
    """A branch for every JSON type but `names` (`number` holds `integer`), none if no type is left."""
    rest = [t for t in TYPES if t not in names]
    return [{"type": rest if len(rest) > 1 else rest[0]}] if rest else []


def excluding_strings(words: list[str]) -> str:
    """A pattern (Rust and Python regex alike, anchored) for every string but `words`."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}
    return f"^(?:{_not_in(trie)})$"


def escape_char(char: str) -> str:
    """`char` as a regex atom both dialects read the same: letters and digits as themselves,
    anything else as a `\\u`/`\\U` escape (also inside a class)."""
    if char.isascii() and char.isalnum():
        return char
    code = ord(char)
    return f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"


##### Internal Helper Functions #####


def _negate(schema: Any) -> Schema | None:
    if isinstance(schema, bool):
        return not schema
    if not isinstance(schema, dict):
        return None
    branches: list[Schema] = []
    for key, value in schema.items():
        if key in _SKIPPED or key.startswith("x-"):
            continue
        rule = _RULES.get(key)
        found = rule(value, schema) if rule is not None else None
        if found is None:
            return None
        branches += found
    return any_of(branches)


def _not_in(node: dict[str, Any]) -> str:
    """Strings that are not a word of the trie `node` (a word ends where the key "" is)."""
    chars = sorted(k for k in node if k)
    alts = [] if "" in node else [""]
    if chars:
        alts.append(f"[^{''.join(map(escape_char, chars))}]{ANY_CHAR}*")
    else:
        alts.append(f"{ANY_CHAR}+")
    alts += [f"{escape_char(c)}(?:{_not_in(node[c])})" for c in chars]
    return "|".join(alts)


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and abs(value) <= MAX_EXACT_NUMBER
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _type(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not set(names) <= {*TYPES, "integer"}:
        return None
    if "integer" in names and "number" not in names:
        return None
    return other_types(*names)


def _enum(values: Any, schema: dict[str, Any]) -> list[Schema] | None:
    """Every value but `values`: the types they miss, then per type what is left of it."""
    if not isinstance(values, list):
        return None
    kinds = {kind_of(v) for v in values}
    if kinds & {"array", "object", "unknown"}:
        return None
    branches = other_types(*kinds)
    if "boolean" in kinds:
        branches += [{"const": b} for b in (False, True) if not any(v is b for v in values)]
    if "number" in kinds:
        numbers = [v for v in values if kind_of(v) == "number"]
        if not all(map(_is_number, numbers)):
            return None
        branches += _outside_points(sorted(set(map(float, numbers))))
    if "string" in kinds:
        words = [v for v in values if isinstance(v, str)]
        branches.append({"type": "string", "pattern": excluding_strings(words)})
    return branches


def _outside_points(points: list[float]) -> list[Schema]:
    """Numbers other than `points` (sorted): the open intervals between them."""
    ints = [int(p) if p.is_integer() else p for p in points]
    out: list[Schema] = [{"type": "number", "exclusiveMaximum": ints[0]}]
    for low, high in zip(ints, ints[1:], strict=False):
        out.append({"type": "number", "exclusiveMinimum": low, "exclusiveMaximum": high})
    out.append({"type": "number", "exclusiveMinimum": ints[-1]})
    return out


def _bound(kind: str, opposite: str) -> Callable[[Any, dict[str, Any]], list[Schema] | None]:
    def rule(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
        return [{"type": kind, opposite: value}] if _is_number(value) else None

    return rule


def _lower_count(kind: str, upper: str) -> Callable[[Any, dict[str, Any]], list[Schema] | None]:
    """`minX: n` is broken by `maxX: n - 1` (by nothing when n is 0)."""

    def rule(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
        if not _is_count(value):
            return None
        return [{"type": kind, upper: value - 1}] if value > 0 else []

    return rule


def _upper_count(kind: str, lower: str) -> Callable[[Any, dict[str, Any]], list[Schema] | None]:
    def rule(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
        return [{"type": kind, lower: value + 1}] if _is_count(value) else None

    return rule


def _required(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return None
    return [{"type": "object", "properties": {name: False}} for name in dict.fromkeys(value)]


def _properties(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
    if not isinstance(value, dict):
        return None
    out: list[Schema] = []
    for name, sub in value.items():
        inverse = _negate(sub)
        if inverse is None:
            return None
        if inverse is not False:
            out.append({"type": "object", "required": [name], "properties": {name: inverse}})
    return out


def _additional_properties(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
    if value is True or value == {}:
        return []
    if value is False and not schema.get("properties") and not schema.get("patternProperties"):
        return [{"type": "object", "minProperties": 1}]
    return None


def _pattern_properties(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
    if isinstance(value, dict) and all(v is True or v == {} for v in value.values()):
        return []
    return None


def _items(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
    """`items` past the `prefixItems`: broken by an item there that breaks it (only `false`)."""
    prefix = schema.get("prefixItems", [])
    if value is True or value == {}:
        return []
    if value is False and isinstance(prefix, list):
        return [{"type": "array", "minItems": len(prefix) + 1}]
    return None


def _prefix_items(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
    if not isinstance(value, list):
        return None
    out: list[Schema] = []
    for i, sub in enumerate(value):
        inverse = _negate(sub)
        if inverse is None:
            return None
        if inverse is not False:
            head: list[Schema] = [True] * i
            out.append({"type": "array", "minItems": i + 1, "prefixItems": [*head, inverse]})
    return out


def _not(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
    return [copy.deepcopy(value)] if isinstance(value, bool | dict) else None


def _all_of(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
    if not isinstance(value, list):
        return None
    out = [_negate(sub) for sub in value]
    return None if any(n is None for n in out) else [n for n in out if n is not None]


def _any_of(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
    if not isinstance(value, list):
        return None
    out = [_negate(sub) for sub in value]
    if any(n is None for n in out):
        return None
    return [all_of([n for n in out if n is not None])]


def _unique_items(value: Any, schema: dict[str, Any]) -> list[Schema] | None:
    return [] if value is False else None


_RULES: dict[str, Callable[[Any, dict[str, Any]], list[Schema] | None]] = {
    "type": _type,
    "enum": _enum,
    "const": lambda value, schema: _enum([value], schema),
    "minimum": _bound("number", "exclusiveMaximum"),
    "maximum": _bound("number", "exclusiveMinimum"),
    "exclusiveMinimum": _bound("number", "maximum"),
    "exclusiveMaximum": _bound("number", "minimum"),
    "minLength": _lower_count("string", "maxLength"),
    "maxLength": _upper_count("string", "minLength"),
    "minItems": _lower_count("array", "maxItems"),
    "maxItems": _upper_count("array", "minItems"),
    "minProperties": _lower_count("object", "maxProperties"),
    "maxProperties": _upper_count("object", "minProperties"),
    "required": _required,
    "properties": _properties,
    "additionalProperties": _additional_properties,
    "patternProperties": _pattern_properties,
    "items": _items,
    "prefixItems": _prefix_items,
    "uniqueItems": _unique_items,
    "not": _not,
    "allOf": _all_of,
    "anyOf": _any_of,
}

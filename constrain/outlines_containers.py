"""Arrays and objects in the outlines schema rewrite (outlines_schema.py): conjuncts, and the
outlines-core forms they become (item arrays, tuples, closed objects, maps)."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Protocol

from weft.constrain.errors import GrammarError

KEYWORDS = frozenset(
    "type enum const allOf anyOf oneOf not if then else $ref $dynamicRef $recursiveRef properties "
    "patternProperties additionalProperties required propertyNames minProperties maxProperties "
    "dependentRequired dependentSchemas dependencies items prefixItems additionalItems contains "
    "minContains maxContains minItems maxItems uniqueItems unevaluatedItems unevaluatedProperties "
    "minLength maxLength pattern format minimum maximum exclusiveMinimum exclusiveMaximum "
    "multipleOf".split()
)
MAX_TUPLE_TAIL = 64  # items after prefixItems listed one length at a time
MAX_OPTIONAL = 8  # optional properties whose subsets are listed for a property count
OPEN_OBJECT = (
    "the outlines backend closes objects: it cannot allow properties besides the declared ones "
    "(at #{}): set additionalProperties: false there, or use the llguidance backend"
)
ANY_VALUE = (
    "the outlines backend cannot generate an arbitrary JSON {} (at #{}: a regex cannot nest "
    "arrays and objects without bound): give it a type and bound its items / properties, or "
    "use the llguidance backend"
)


@dataclass(frozen=True)
class Conjunct:
    """One schema a value must match: `node` (at `pointer`) holds the keywords still to rewrite,
    `check` the schema as written (listed values are validated against it); `refs`: the `$ref`
    targets being expanded around it (a repeat is recursion)."""

    pointer: str
    node: Any
    check: Any
    refs: frozenset[str]

    def sub(self, relative: str, schema: Any) -> Conjunct:
        """A subschema of this one's node, at `relative` (escaped) below it."""
        return Conjunct(f"{self.pointer}/{relative}", schema, schema, self.refs)


class Lowering(Protocol):
    def lower(self, conjuncts: list[Conjunct]) -> list[Any]: ...

    def skip(self, keyword: str, pointer: str, why: str = "") -> None: ...

    def valid(self, schema: Any, value: Any) -> bool: ...


##### Public API #####


def lower_array(lw: Lowering, cs: list[Conjunct]) -> list[Any]:
    """The arrays that match every conjunct: `items` arrays, or tuples of each length."""
    low = max((count(c, "minItems") for c in cs if "minItems" in c.node), default=0)
    highs = [count(c, "maxItems") for c in cs if "maxItems" in c.node]
    limit: int | None = min(highs) if highs else None
    parts = {id(c): _array_parts(c) for c in cs}
    width = max((len(p[0]) for p in parts.values()), default=0)

    def position(i: int) -> list[Conjunct]:
        out = []
        for c in cs:
            prefix, prefix_key, tail, tail_key = parts[id(c)]
            if i < len(prefix):
                out.append(c.sub(f"{prefix_key}/{i}", prefix[i]))
            elif tail is not None:
                out.append(c.sub(tail_key, tail))
        return out

    _skip_array_keywords(lw, cs, limit)
    positions: list[Any] = []
    for i in range(width):
        if limit is not None and i >= limit:
            break
        found = lw.lower(position(i))
        if not found:
            limit = i
            break
        positions.append(one_of(found))
    tail = None
    if limit is None or limit > width:
        rest = position(width)
        if not constrains(rest):
            raise GrammarError(ANY_VALUE.format("array", cs[0].pointer if cs else ""))
        found = lw.lower(rest)
        tail = one_of(found) if found else None
        limit = width if tail is None else limit
    if limit is not None and low > limit:
        return []
    if width == 0:
        if limit == 0:
            return [{"type": "array", "maxItems": 0}]
        bounds = {"minItems": low} | ({} if limit is None else {"maxItems": limit})
        return [{"type": "array", "items": tail, **bounds}]
    if limit is None or limit - width > MAX_TUPLE_TAIL:
        raise GrammarError(
            "the outlines backend cannot follow prefixItems with any number of items (at "
            f"#{cs[0].pointer}): set maxItems (at most {MAX_TUPLE_TAIL} past the prefix) or "
            "items: false, or use the llguidance backend"
        )
    return [
        {"prefixItems": [positions[i] if i < width else tail for i in range(n)]}
        if n
        else {"type": "array", "maxItems": 0}
        for n in range(low, limit + 1)
    ]


def lower_object(lw: Lowering, cs: list[Conjunct]) -> list[Any]:
    """The objects that match every conjunct: closed objects (each property set the counts
    allow, when they must be listed), or maps of one value schema."""
    names = list(dict.fromkeys(n for c in cs for n in _dict(c.node.get("properties"))))
    required = list(dict.fromkeys(n for c in cs for n in c.node.get("required") or []))
    low = max((count(c, "minProperties") for c in cs if "minProperties" in c.node), default=0)
    highs = [count(c, "maxProperties") for c in cs if "maxProperties" in c.node]
    high = min(highs) if highs else None
    closing = [c for c in cs if is_false(c.node.get("additionalProperties"))]
    for c in cs:
        extra = c.node.get("unevaluatedProperties", True)
        if extra is not True and "additionalProperties" not in c.node:
            lw.skip("unevaluatedProperties", f"{c.pointer}/unevaluatedProperties")
    for c in closing:
        if _dict(c.node.get("patternProperties")):
            raise GrammarError(
                "the outlines backend cannot allow undeclared properties by patternProperties "
                f"(at #{c.pointer}/patternProperties); use the llguidance backend"
            )
    if high == 0:
        return [] if required else [closed_object({}, [])]
    if not closing:
        if names:
            raise GrammarError(OPEN_OBJECT.format(cs[0].pointer))
        return _map(lw, cs, low, high)
    props: dict[str, Any] = {}
    for name in names:
        found = lw.lower(_property(lw, cs, name))
        if not found and name in required:
            return []
        if found:
            props[name] = one_of(found)
    if any(name not in props for name in required):
        return []
    optional = [name for name in props if name not in required]
    if (high is not None and high < len(required)) or low > len(props):
        return []
    if low <= len(required) and (high is None or high >= len(props)):
        return [closed_object(props, required)]
    if len(optional) > MAX_OPTIONAL:
        for c in cs:
            for key in ("minProperties", "maxProperties"):
                if key in c.node:
                    lw.skip(key, f"{c.pointer}/{key}", f"over {MAX_OPTIONAL} optional properties")
        return [closed_object(props, required)]
    out = []
    least, most = (
        max(low - len(required), 0),
        len(optional) if high is None else high - len(required),
    )
    for k in range(least, min(most, len(optional)) + 1):
        for chosen in itertools.combinations(optional, k):
            keep = set(required) | set(chosen)
            out.append(closed_object({n: s for n, s in props.items() if n in keep}, list(keep)))
    return out


def one_of(alternatives: list[Any]) -> Any:
    """The alternatives as one schema."""
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def closed_object(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """Objects with only the properties of `props` (in its order), those of `required` present."""
    if not props:
        return {"type": "object", "maxProperties": 0}
    need = [name for name in props if name in required]
    return {"type": "object", "properties": props, "required": need, "additionalProperties": False}


def spellable(name: str) -> bool:
    """Whether outlines-core writes the property name `name` as JSON (it escapes nothing)."""
    return not any(ch in '"\\' or ord(ch) < 0x20 for ch in name)


def escape(part: str) -> str:
    """A JSON-pointer segment."""
    return part.replace("~", "~0").replace("/", "~1")


def count(c: Conjunct, key: str) -> int:
    """A count keyword's value (JSON Schema counts 2.0 as 2)."""
    value = c.node[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise GrammarError(f"invalid json_schema: {key} is a non-negative integer (#{c.pointer})")
    if isinstance(value, float) and not value.is_integer():
        raise GrammarError(f"invalid json_schema: {key} is a non-negative integer (#{c.pointer})")
    return int(value)


def constrains(cs: list[Conjunct]) -> bool:
    """Whether any of `cs` restricts a value at all."""
    return any(
        c.node is False or (isinstance(c.node, dict) and not KEYWORDS.isdisjoint(c.node))
        for c in cs
    )


def keywords(schema: Any) -> list[str]:
    """The keywords of a schema that restrict a value ([] for `true` and `{}`)."""
    if schema is True:
        return []
    if not isinstance(schema, dict):
        return ["false"]
    return [k for k in schema if k in KEYWORDS]


def is_false(schema: Any) -> bool:
    """Whether `schema` matches no value (`false`, `{"not": {}}`, `{"not": true}`)."""
    return schema is False or (
        isinstance(schema, dict) and "not" in schema and not keywords(schema["not"])
    )


##### Internal Helper Functions #####


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _array_parts(c: Conjunct) -> tuple[list[Any], str, Any, str]:
    """(the positional schemas, their keyword, the schema of the items after them (None: no
    constraint), its keyword): `prefixItems` + `items`, or draft 7's `items` list +
    `additionalItems`."""
    node = c.node
    if isinstance(node.get("items"), list):
        return node["items"], "items", node.get("additionalItems"), "additionalItems"
    prefix = node.get("prefixItems")
    return prefix if isinstance(prefix, list) else [], "prefixItems", node.get("items"), "items"


def _skip_array_keywords(lw: Lowering, cs: list[Conjunct], limit: int | None) -> None:
    """Report what arrays leave unenforced: uniqueItems (unless at most one item), contains and
    its counts, unevaluatedItems (unless `items` covers every item)."""
    for c in cs:
        node = c.node
        if node.get("uniqueItems") is True and (limit is None or limit > 1):
            lw.skip("uniqueItems", f"{c.pointer}/uniqueItems")
        vacuous = "minContains" in node and count(c, "minContains") == 0
        if "contains" in node and not (vacuous and "maxContains" not in node):
            for key in ("contains", "minContains", "maxContains"):
                if key in node:
                    lw.skip(key, f"{c.pointer}/{key}")
        covered = "items" in node and not isinstance(node["items"], list)
        if node.get("unevaluatedItems", True) is not True and not covered:
            lw.skip("unevaluatedItems", f"{c.pointer}/unevaluatedItems")


def _property(lw: Lowering, cs: list[Conjunct], name: str) -> list[Conjunct]:
    """The conjuncts of the value of property `name` (false where a conjunct forbids it)."""
    if not spellable(name):
        raise GrammarError(
            f"the outlines backend cannot write the property name {name!r} (it escapes nothing)"
        )
    out = []
    for c in cs:
        props = _dict(c.node.get("properties"))
        if name in props:
            out.append(c.sub(f"properties/{escape(name)}", props[name]))
        matched = False
        for pattern, sub in _dict(c.node.get("patternProperties")).items():
            try:
                found = re.search(pattern, name) is not None
            except re.error as e:
                raise GrammarError(f"invalid patternProperties key {pattern!r}: {e}") from None
            if found:
                out.append(c.sub(f"patternProperties/{escape(pattern)}", sub))
                matched = True
        if name not in props and not matched and "additionalProperties" in c.node:
            out.append(c.sub("additionalProperties", c.node["additionalProperties"]))
        names = c.node.get("propertyNames")
        if names is not None and not lw.valid(names, name):
            out.append(c.sub("propertyNames", False))
    if not constrains(out):
        raise GrammarError(ANY_VALUE.format("value", f"{cs[0].pointer}/properties/{escape(name)}"))
    return out


def _map(lw: Lowering, cs: list[Conjunct], low: int, high: int | None) -> list[Any]:
    """Objects of any property names whose values match one schema (`additionalProperties`)."""
    for c in cs:
        if _dict(c.node.get("patternProperties")):
            raise GrammarError(
                "the outlines backend cannot give patternProperties values their own schema in an "
                f"object of any property names (at #{c.pointer}); use the llguidance backend"
            )
        names = c.node.get("propertyNames", True)
        if is_false(names):
            return [closed_object({}, [])]
        if keywords(names):
            lw.skip("propertyNames", f"{c.pointer}/propertyNames")
    values = [
        c.sub("additionalProperties", c.node["additionalProperties"])
        for c in cs
        if "additionalProperties" in c.node
    ]
    if not constrains(values):
        raise GrammarError(ANY_VALUE.format("object", cs[0].pointer if cs else ""))
    found = lw.lower(values)
    if not found:
        return [closed_object({}, [])] if low == 0 else []
    for c in cs:
        if c.node.get("required"):
            lw.skip("required", f"{c.pointer}/required", "in an object of any property names")
        if "minProperties" in c.node and count(c, "minProperties") > 1:
            lw.skip("minProperties", f"{c.pointer}/minProperties")
        if "maxProperties" in c.node and high is not None and high > 0:
            lw.skip("maxProperties", f"{c.pointer}/maxProperties")
    out = {"type": "object", "additionalProperties": one_of(found)}
    return [out | ({"minProperties": 1} if low > 0 else {})]

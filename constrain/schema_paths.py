"""Where a keyword sits in a schema (JSON pointers for refusals), and weft's rewrites of valid
schemas that the library would misread."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from weft.constrain.schema import subschemas

# Keywords whose value is a non-negative integer; JSON Schema counts 2.0 as the integer 2.
COUNT_KEYWORDS = frozenset(
    "minItems maxItems minLength maxLength minProperties maxProperties minContains "
    "maxContains".split()
)


def walk_pointers(schema: Any, pointer: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(JSON pointer, schema object) for every subschema object, breadth first: the shallowest
    occurrence of a keyword comes first."""
    queue: list[tuple[str, Any]] = [(pointer, schema)]
    while queue:
        here, node = queue.pop(0)
        if not isinstance(node, dict):
            continue
        yield here, node
        queue += [(f"{here}/{rel}", sub) for rel, sub in _children(node)]


def keyword_pointer(schema: Any, keyword: str) -> str | None:
    """The JSON pointer (URI fragment form, `#/properties/a/uniqueItems`) of the first place
    `keyword` is used: a keyword name, `format:<name>` (a `format` with that value) or
    `$ref:<uri>` (a `$ref` into that document); None if not found."""
    name, _, value = keyword.partition(":") if keyword.startswith(("format:", "$ref:")) else (
        keyword, "", "")  # fmt: skip
    for pointer, node in walk_pointers(schema):
        if name not in node:
            continue
        if name == "format" and node[name] != value:
            continue
        if name == "$ref" and not str(node[name]).startswith(value.partition("#")[0]):
            continue
        return f"#{pointer}/{_escape(name)}"
    return None


def located(schema: Any, keywords: list[str]) -> str:
    """`keywords` as `name (at #/pointer)`, comma-separated, for a refusal's message."""
    parts = []
    for keyword in keywords:
        pointer = keyword_pointer(schema, keyword)
        parts.append(keyword if pointer is None else f"{keyword} (at {pointer})")
    return ", ".join(parts)


def integral_counts(schema: Any) -> Any:
    """A copy of `schema` where counts written as integral floats (`"maxItems": 2.0`) are ints
    (valid JSON Schema, which the library refuses); `schema` itself if there are none."""
    if not any(_float_counts(node) for _, node in walk_pointers(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for _, node in walk_pointers(schema):
        for key in _float_counts(node):
            node[key] = int(node[key])
    return schema


##### Internal Helper Functions #####


def _children(node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(relative pointer, escaped; subschema) of each direct subschema object, as
    schema.subschemas finds them."""
    found = {id(s) for s in subschemas(node)}
    for key, value in node.items():
        if isinstance(value, dict) and id(value) in found:
            yield _escape(key), value
        elif isinstance(value, dict):
            for name, sub in value.items():
                if id(sub) in found and isinstance(sub, dict):
                    yield f"{_escape(key)}/{_escape(name)}", sub
        elif isinstance(value, list):
            for i, sub in enumerate(value):
                if id(sub) in found and isinstance(sub, dict):
                    yield f"{_escape(key)}/{i}", sub


def _float_counts(node: dict[str, Any]) -> list[str]:
    return [
        key
        for key in COUNT_KEYWORDS
        if isinstance(node.get(key), float) and node[key].is_integer() and node[key] >= 0
    ]


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")

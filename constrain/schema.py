"""JSON-schema keyword policy: what each backend enforces, strips (reported) or refuses."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urljoin, urlsplit

from weft.constrain.regex_text import ascii_classes, json_string_classes

# Keywords that never constrain an instance (ignored by every backend, never reported).
ANNOTATIONS = frozenset(
    "title description default examples $schema $id $comment $anchor deprecated readOnly "
    "writeOnly contentMediaType contentEncoding contentSchema".split()
)
# Real subschema positions (never `enum`/`const`/`default`/`examples` data): maps of them, lists
# of them, and single ones (or a list, for draft-07's array-form `items`). `dependencies` maps to a
# schema or to a list of property names (not a dict: skipped).
_SUBSCHEMA_MAPS = (
    "properties",
    "$defs",
    "definitions",
    "patternProperties",
    "dependentSchemas",
    "dependencies",
)
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
)


def walk(schema: Any) -> Iterator[dict[str, Any]]:
    """Every (sub)schema object in `schema`, parents first (a parent's keywords are read after
    it is yielded: a caller may delete keywords to keep the walk out of them)."""
    if not isinstance(schema, dict):
        return
    yield schema
    for sub in subschemas(schema):
        yield from walk(sub)


def subschemas(schema: dict[str, Any]) -> Iterator[Any]:
    """The direct subschemas of a schema object (boolean schemas included)."""
    for key in _SUBSCHEMA_MAPS:
        subs = schema.get(key)
        if isinstance(subs, dict):
            yield from subs.values()
    for key in _SUBSCHEMA_LISTS:
        subs = schema.get(key)
        if isinstance(subs, list):
            yield from subs
    for key in _SUBSCHEMAS:
        sub = schema.get(key)
        yield from sub if isinstance(sub, list) else [sub]


def map_subschemas(schema: dict[str, Any], fn: Callable[[Any], Any]) -> None:
    """Replace each direct subschema of `schema` (as `subschemas` finds them) by `fn(it)`, in
    place; values in those positions that are no schema (a draft-07 `dependencies` list) too."""
    for key in _SUBSCHEMA_MAPS:
        subs = schema.get(key)
        if isinstance(subs, dict):
            schema[key] = {name: fn(sub) for name, sub in subs.items()}
    for key in _SUBSCHEMA_LISTS:
        subs = schema.get(key)
        if isinstance(subs, list):
            schema[key] = [fn(sub) for sub in subs]
    for key in _SUBSCHEMAS:
        if key in schema:
            sub = schema[key]
            schema[key] = [fn(s) for s in sub] if isinstance(sub, list) else fn(sub)


##### Schema surgery: what a backend cannot enforce, removed from a copy (and reported) #####

# llguidance's base URI for a schema without an `$id` (what its registry errors name).
DEFAULT_BASE_URI = "json-schema:///"


def without_remote_refs(schema: dict[str, Any], uri: str) -> tuple[dict[str, Any], int]:
    """(a copy of `schema` where no subschema has a `$ref` into the document `uri`, how many
    `$ref`s were removed). Their sibling keywords stay; a subschema left empty accepts anything.

    A `$ref` is resolved against the base URI in scope: the root's and every nested `$id` (`id`
    in a draft-04 schema), over `DEFAULT_BASE_URI`; documents are compared without fragments, and
    the ref as written (without its fragment) matches too.
    """
    schema = copy.deepcopy(schema)
    target = _document(uri)
    dialect = schema.get("$schema")
    id_key = "id" if isinstance(dialect, str) and "draft-04" in dialect else "$id"
    removed = 0

    def visit(node: Any, base: str) -> None:
        nonlocal removed
        if not isinstance(node, dict):
            return
        if isinstance(node.get(id_key), str):
            base = resolve_document(base, node[id_key])
        ref = node.get("$ref")
        if isinstance(ref, str) and target in (_document(ref), resolve_document(base, ref)):
            del node["$ref"]
            removed += 1
        for sub in subschemas(node):
            visit(sub, base)

    visit(schema, DEFAULT_BASE_URI)
    return schema, removed


def resolve_document(base: str, ref: str) -> str:
    """The document `ref` refers to from `base` (urljoin, which does not know llguidance's
    `json-schema:` scheme: it is resolved as `file:` is)."""
    scheme = "json-schema:"
    if base.startswith(scheme) and not urlsplit(ref).scheme:
        return scheme + _document(urljoin("file:" + base[len(scheme) :], ref))[len("file:") :]
    return _document(urljoin(base, ref))


def _document(uri: str) -> str:
    """`uri` without its fragment (NOTE: not urldefrag: it drops the `//` of an unknown scheme)."""
    return uri.partition("#")[0]


def without_patterns(
    schema: dict[str, Any], compiles: Callable[[str], bool]
) -> tuple[dict[str, Any], list[str]]:
    """(a copy of `schema` without every subschema's string `pattern` that `compiles` rejects,
    those patterns). `patternProperties` keys are left alone: dropping one would change which
    properties are allowed, not just loosen a string."""
    schema = copy.deepcopy(schema)
    dropped: list[str] = []
    for node in walk(schema):
        pattern = node.get("pattern")
        if isinstance(pattern, str) and not compiles(pattern):
            del node["pattern"]
            dropped.append(pattern)
    return schema, list(dict.fromkeys(dropped))


def string_patterns(schema: Any) -> Any:
    """`schema` with every regex (`pattern`, `patternProperties` keys) as llguidance must read
    it: `\\d` `\\w` `\\s` (and negations) as Python's ASCII classes (regex_text.ascii_classes),
    negated classes quoted exactly in a JSON string (regex_text.json_string_classes). A copy if
    any changes, else `schema` itself."""

    done: dict[str, str] = {}

    def fixed(pattern: str) -> str:
        if pattern not in done:
            done[pattern] = ascii_classes(json_string_classes(pattern))
        return done[pattern]

    def changes(node: dict[str, Any]) -> bool:
        pattern, props = node.get("pattern"), node.get("patternProperties")
        keys = props if isinstance(props, dict) else {}
        return (isinstance(pattern, str) and fixed(pattern) != pattern) or any(
            fixed(k) != k for k in keys
        )

    if not any(changes(node) for node in walk(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for node in walk(schema):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = fixed(node["pattern"])
        props = node.get("patternProperties")
        if isinstance(props, dict):
            node["patternProperties"] = {fixed(k): v for k, v in props.items()}
    return schema


##### llguidance: the library reports what it skipped #####


def llguidance_keywords(messages: list[str]) -> list[str]:
    """Keyword names from llguidance's warnings/errors (lenient warnings or a strict error)."""
    found: list[str] = []
    for text in messages:
        if not text.strip():
            continue
        msg = _REPEATS.sub("", text.strip().splitlines()[0])
        if msg.startswith("Unimplemented keys: "):
            found += _leading_json_list(msg[len("Unimplemented keys: ") :]) or [msg[:200]]
        elif msg.startswith("Unknown format: "):
            found.append("format:" + msg[len("Unknown format: ") :].strip())
        elif msg.startswith("oneOf"):
            found.append("oneOf")
        else:
            found.append(msg[:200])
    return list(dict.fromkeys(found))


_REPEATS = re.compile(r" \(\d+ times\)$")  # llguidance's suffix on a repeated warning


def _leading_json_list(text: str) -> list[str]:
    """The JSON list of strings that `text` starts with; [] if it does not start with one."""
    try:
        value, _ = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(value, list):
        return []
    return [str(v) for v in value]

"""JSON-schema keyword policy: what each backend enforces, strips (reported) or refuses."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urljoin, urlsplit

from weft.constrain.errors import GrammarError
from weft.constrain.regex_text import ascii_classes

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
            base = _resolve(base, node[id_key])
        ref = node.get("$ref")
        if isinstance(ref, str) and target in (_document(ref), _resolve(base, ref)):
            del node["$ref"]
            removed += 1
        for sub in subschemas(node):
            visit(sub, base)

    visit(schema, DEFAULT_BASE_URI)
    return schema, removed


def _resolve(base: str, ref: str) -> str:
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


def ascii_class_patterns(schema: Any) -> Any:
    """A copy of `schema` with `\\d` `\\w` `\\s` (and negations) read as Python's ASCII classes in
    every regex (`pattern`, `patternProperties` keys): regex_text.ascii_classes."""
    schema = copy.deepcopy(schema)
    for node in walk(schema):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = ascii_classes(node["pattern"])
        props = node.get("patternProperties")
        if isinstance(props, dict):
            node["patternProperties"] = {ascii_classes(k): v for k, v in props.items()}
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


##### outlines: audited here, since outlines-core drops unknown keywords silently #####

OUTLINES_FORMATS = frozenset({"date", "date-time", "time", "email", "uuid", "uri"})
_OUTLINES_ENFORCED = frozenset(
    "type properties required additionalProperties items prefixItems minItems maxItems enum const "
    "anyOf oneOf $ref $defs definitions minLength maxLength pattern format".split()
)
# Constraints whose removal only loosens the schema: stripped and reported (refused if strict).
_OUTLINES_STRIPPABLE = frozenset(
    "minimum maximum exclusiveMinimum exclusiveMaximum multipleOf uniqueItems contains minContains "
    "maxContains dependentRequired dependentSchemas dependencies propertyNames minProperties "
    "maxProperties unevaluatedProperties unevaluatedItems additionalItems not if then else".split()
)
# outlines-core's JSON string body (a pattern is matched against the raw JSON text of a string).
_STRING_CHAR = r'(?:[^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])'


def prepare_for_outlines(schema: Any, strict: bool) -> tuple[Any, list[str]]:
    """(a copy of `schema` that outlines-core compiles faithfully, the keywords left unenforced).

    Raises GrammarError for what outlines-core would get wrong in a way stripping cannot fix
    (stricter than the schema: blocking valid instances) and, when `strict`, for anything stripped.
    """
    schema = json.loads(json.dumps(schema))  # deep copy
    _refuse_recursion(schema)
    unenforced: list[str] = []
    for node in walk(schema):
        unenforced += _prepare_node(node)
    unenforced = list(dict.fromkeys(unenforced))
    if strict and unenforced:
        names = ", ".join(unenforced)
        raise GrammarError(f"unsupported JSON schema keyword(s) for outlines: {names}", unenforced)
    return schema, unenforced


def _prepare_node(node: dict[str, Any]) -> list[str]:
    stripped: list[str] = []
    for key in list(node):
        if key in ANNOTATIONS or key.startswith("x-"):
            continue
        if key in _OUTLINES_STRIPPABLE:
            del node[key]
            stripped.append(key)
        elif key in ("allOf", "patternProperties", "$dynamicRef", "$recursiveRef"):
            raise GrammarError(f"'{key}' is not supported by the outlines backend", [key])
    fmt = node.get("format")
    if fmt is not None and fmt not in OUTLINES_FORMATS:
        del node["format"]
        stripped.append(f"format:{fmt}")
    if isinstance(node.get("items"), list):
        raise GrammarError("array-form 'items' is not supported by the outlines backend", ["items"])
    extra = node.get("additionalProperties")
    if "properties" in node and extra not in (None, False):
        raise GrammarError(
            "the outlines backend cannot allow additionalProperties next to declared properties",
            ["additionalProperties"],
        )
    items = node.get("prefixItems")
    if isinstance(items, list) and node.get("minItems", 0) < len(items):
        raise GrammarError(
            "the outlines backend requires every prefixItems entry (set minItems to its length)",
            ["prefixItems"],
        )
    if any(
        set(name) & set('"\\') or not name.isprintable() for name in node.get("properties") or {}
    ):
        raise GrammarError("the outlines backend cannot escape this property name", ["properties"])
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        node["pattern"] = _anchor(pattern)
    if "oneOf" in node and not _disjoint(node["oneOf"]):
        node["anyOf"] = node.pop("oneOf")
        stripped.append("oneOf")
    return stripped


def _anchor(pattern: str) -> str:
    """JSON Schema patterns search; outlines-core anchors them, so pad the unanchored ends."""
    start = pattern.startswith("^")
    end = pattern.endswith("$") and not pattern.endswith("\\$")
    if start and end:
        return pattern
    body = pattern[1 if start else 0 : len(pattern) - (1 if end else 0)]
    head = "" if start else f"{_STRING_CHAR}*"
    tail = "" if end else f"{_STRING_CHAR}*"
    return f"^{head}(?:{body}){tail}$"


def _json_types(schema: Any) -> set[str] | None:
    """The JSON types a branch can produce, or None if unknown ('number' includes integers)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return {_type_of(v) for v in values}
    kinds = schema.get("type")
    if kinds is None:
        return None
    types = set(kinds if isinstance(kinds, list) else [kinds])
    return {"number" if t == "integer" else t for t in types}


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}[type(value)]


def _discriminator(schema: Any) -> tuple[str, str] | None:
    """(property, const JSON) for an object branch that requires a const-valued property."""
    if not isinstance(schema, dict):
        return None
    for name, sub in (schema.get("properties") or {}).items():
        if isinstance(sub, dict) and "const" in sub and name in schema.get("required", ()):
            return name, json.dumps(sub["const"])
    return None


def _disjoint(branches: list[Any]) -> bool:
    """Whether no instance can match two branches (so oneOf == anyOf), by cheap sufficient tests."""
    types = [_json_types(b) for b in branches]
    known = [t for t in types if t is not None]
    if len(known) == len(types) and sum(map(len, known)) == len(set().union(*known)):
        return True
    tags = [_discriminator(b) for b in branches]
    if all(tag is not None for tag in tags):
        names = {tag[0] for tag in tags if tag is not None}
        return len(names) == 1 and len(set(tags)) == len(tags)
    return False


def _refuse_recursion(schema: dict[str, Any]) -> None:
    """outlines-core unrolls recursive $refs to a fixed depth, blocking deeper valid instances."""

    def resolve(ref: str) -> Any:
        if not ref.startswith("#"):
            raise GrammarError(f"remote $ref {ref!r} is not supported", ["$ref"])
        node: Any = schema
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            raise GrammarError(f"$ref {ref!r} does not resolve", ["$ref"])
        return node

    done: set[str] = set()  # refs fully explored: no cycle runs through them

    def visit(node: Any, stack: tuple[str, ...]) -> None:
        for sub in walk(node):
            ref = sub.get("$ref")
            if not isinstance(ref, str) or ref in done:
                continue
            if ref in stack:
                raise GrammarError(
                    "recursive $ref is not supported by the outlines backend", ["$ref"]
                )
            visit(resolve(ref), (*stack, ref))
            done.add(ref)

    visit(schema, ())

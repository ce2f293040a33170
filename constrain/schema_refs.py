"""Recursive `$ref`s with sibling keywords, which llguidance refuses ("circular references with
sibling keys are not supported"), rewritten into plain `$ref`s to merged definitions.

In draft 2020-12 `{"$ref": X, ...siblings}` means "X and the siblings". Where X's keywords and the
siblings' keywords are disjoint and no keyword reads a sibling on the other side (`properties` vs
`additionalProperties`, `items` vs `prefixItems`, ...), that is the schema X with the siblings
added: a new `$defs` entry. Its own inner `$ref`s with siblings are merged the same way (the same
X and siblings give the same entry), so a recursive schema stays recursive, exactly.

Keywords on both sides merge where that is exact too: `type` (the types both allow), `required`
(both lists), `properties` (a name on both sides gets both schemas, under `allOf`) where neither
side has `additionalProperties` or `patternProperties`.

An `anyOf` / `oneOf` of plain `$ref`s with sibling keywords (`{"type": "object", "anyOf": [{"$ref":
A}, {"$ref": B}]}`), which the library refuses the same way where a branch recurses, is first
rewritten with the siblings in each branch (`{"anyOf": [{"$ref": A, "type": "object"}, ...]}`:
S and one of the B_i is one of (S and B_i), for anyOf and oneOf alike), then merged as above.

A case outside this (other keywords on both sides, `unevaluated*`, `$id`, dynamic refs) is left
as written: the library refuses it with its own message, as before.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from weft.constrain.schema import walk

MERGED_PREFIX = "weft-merged-"
MAX_MERGED = 64  # merged definitions at most (each distinct target and siblings is one)
# keywords that read their neighbours: a group split across the two sides is not a plain union
_GROUPS = [
    {"properties", "patternProperties", "additionalProperties"},
    {"prefixItems", "items"},
    {"contains", "minContains", "maxContains"},
    {"if", "then", "else"},
]
_ANNOTATIONS = frozenset("$comment title description examples default deprecated".split())
_NOT_SIBLINGS = _ANNOTATIONS | {"$ref", "$defs", "definitions"}
# what stays on a node whose siblings go into its anyOf / oneOf branches
_KEPT = _NOT_SIBLINGS | {"anyOf", "oneOf", "$schema", "id"}
_OBJECT_OPEN = {"additionalProperties", "patternProperties"}  # read `properties`
_NOT_MERGED = frozenset(
    "unevaluatedProperties unevaluatedItems $id $anchor $dynamicRef $dynamicAnchor "
    "$recursiveRef $recursiveAnchor $ref".split()
)


def merged_sibling_refs(schema: Any) -> Any:
    """A copy of `schema` where each `$ref` with sibling keywords that recursion reaches again is a
    plain `$ref` to a merged definition; `schema` itself if there is none (or one it can't merge)."""
    if not isinstance(schema, dict) or "$ref" not in json.dumps(schema):
        return schema
    if any(k in node for node in walk(schema) for k in ("$dynamicRef", "$recursiveRef")):
        return schema
    if any("$id" in node for node in walk(schema) if node is not schema):
        return schema
    original, schema = schema, _distributed(schema)
    circular = _circular_sibling_refs(schema)
    if not circular:
        return original
    merger = _Merger(schema, circular)
    out = copy.deepcopy(schema)
    for node in walk(out):
        name = merger.name_for(node) if _key(node) in circular else None
        if name is not None:
            node.clear()
            node["$ref"] = f"#/$defs/{name}"
    if merger.failed or not merger.defs:
        return original
    out["$defs"] = {**out.get("$defs", {}), **merger.defs}
    return out


def resolve_pointer(schema: Any, ref: Any) -> Any:
    """The subschema a local JSON-pointer `$ref` (`#`, `#/a/b`) names; None if it names none."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = schema
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


##### Internal Helper Functions #####


def _key(node: dict[str, Any]) -> str:
    return json.dumps(node, sort_keys=True)


def _distributed(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` where each `anyOf` / `oneOf` of plain `$ref`s that has sibling
    keywords holds them in each branch instead; `schema` itself if none has."""
    if not any(_distributable(node) for node in walk(schema)):
        return schema
    out = copy.deepcopy(schema)
    for node in list(walk(out)):
        if _distributable(node):
            (key,) = {"anyOf", "oneOf"} & set(node)
            siblings = {k: node.pop(k) for k in list(node) if k not in _KEPT}
            node[key] = [{**branch, **copy.deepcopy(siblings)} for branch in node[key]]
    return out


def _distributable(node: dict[str, Any]) -> bool:
    keys = {"anyOf", "oneOf"} & set(node)
    if len(keys) != 1 or _NOT_MERGED & set(node):
        return False
    branches = node[next(iter(keys))]
    plain = isinstance(branches, list) and all(
        isinstance(b, dict) and "$ref" in b and not _has_siblings(b) for b in branches
    )
    return plain and any(k not in _KEPT for k in node)


def _has_siblings(node: dict[str, Any]) -> bool:
    return "$ref" in node and any(k not in _NOT_SIBLINGS for k in node)


def _refs(node: Any) -> list[str]:
    return [n["$ref"] for n in walk(node) if isinstance(n.get("$ref"), str)]


def _circular_sibling_refs(schema: dict[str, Any]) -> set[str]:
    """The `_key`s of the `$ref`-with-siblings nodes that resolving their own target reaches."""
    found: set[str] = set()
    for node in walk(schema):
        if not _has_siblings(node):
            continue
        seen, todo = set(), [node["$ref"]]
        while todo:
            ref = todo.pop()
            target = resolve_pointer(schema, ref)
            if ref in seen or target is None:
                continue
            seen.add(ref)
            if any(n is node for n in walk(target)):
                found.add(_key(node))
                break
            todo += _refs(target)
    return found


class _Merger:
    """Merged definitions by (target, siblings); `failed` once a merge is not exact."""

    def __init__(self, schema: dict[str, Any], circular: set[str]) -> None:
        self.schema = schema
        self.circular = circular
        self.defs: dict[str, Any] = {}
        self.names: dict[str, str] = {}
        self.failed = False

    def name_for(self, node: dict[str, Any]) -> str | None:
        key = _key(node)
        if key in self.names:
            return self.names[key]
        target = resolve_pointer(self.schema, node["$ref"])
        siblings = {k: v for k, v in node.items() if k not in _NOT_SIBLINGS}
        merged = _merged(target, siblings)
        if merged is None or len(self.names) >= MAX_MERGED:
            self.failed = True
            return None
        name = f"{MERGED_PREFIX}{len(self.names)}"
        self.names[key] = name
        for inner in walk(merged):  # NOTE: named first, so a recursive one finds itself
            if _key(inner) in self.circular and (inner_name := self.name_for(inner)) is not None:
                inner.clear()
                inner["$ref"] = f"#/$defs/{inner_name}"
        self.defs[name] = merged
        return name


def _merged(target: Any, siblings: dict[str, Any]) -> Any:
    """`target` and `siblings` as one schema, where that is exact; else None."""
    if target is False:
        return False
    if target is True:
        return copy.deepcopy(siblings)
    if not isinstance(target, dict) or _NOT_MERGED & (set(target) | set(siblings)):
        return None
    own = {k: v for k, v in target.items() if k not in ("$defs", "definitions", "$schema", "id")}
    both = set(own) & set(siblings) - _ANNOTATIONS
    open_object = _OBJECT_OPEN & (set(own) | set(siblings))
    if both - {"required", "type", "properties"} or ("properties" in both and open_object):
        return None
    for group in _GROUPS:
        if group & set(own) and group & set(siblings) and group & both != {"properties"}:
            return None
    merged = copy.deepcopy(own)
    for key, value in siblings.items():
        if key not in merged:
            merged[key] = copy.deepcopy(value)
            continue
        if key in _ANNOTATIONS:  # (the target's own annotation stands)
            continue
        joined = _joined(key, merged[key], value)
        if joined is None:
            return None
        merged[key] = joined
    return merged


def _joined(key: str, mine: Any, theirs: Any) -> Any:
    """Keyword `key` of both schemas as one value that means both; None where it can't."""
    if key == "required" and isinstance(mine, list) and isinstance(theirs, list):
        return list(dict.fromkeys([*mine, *theirs]))
    if key == "properties" and isinstance(mine, dict) and isinstance(theirs, dict):
        out = copy.deepcopy(mine)
        for name, sub in theirs.items():
            sub = copy.deepcopy(sub)
            out[name] = {"allOf": [out[name], sub]} if name in out else sub
        return out
    if key == "type":
        a, b = _types(mine), _types(theirs)
        if a is None or b is None:
            return None
        both = [t for t in a if t in b or (t == "integer" and "number" in b)]
        both += [t for t in b if t == "integer" and "number" in a and t not in both]
        return (both[0] if len(both) == 1 else both) if both else None
    return None


def _types(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return list(value)
    return None

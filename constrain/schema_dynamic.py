"""`$dynamicRef` / `$dynamicAnchor` rewritten as the `$ref` / `$anchor` they behave as, where the
dynamic scope cannot change what they resolve to (draft 2020-12).

A `$dynamicRef` is a `$ref` unless its fragment is a plain name whose static target carries a
`$dynamicAnchor` of that name; then the outermost resource in the dynamic scope with such an anchor
wins. So it is exactly a `$ref` when its fragment is a JSON pointer (or empty), when its static
target has no `$dynamicAnchor` of that name, or when only one schema in the document has one (the
scope can find no other). Once no `$dynamicRef` is left, a `$dynamicAnchor` is an `$anchor` (or,
beside another `$anchor` and never referred to, nothing). Anything else is left as written.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from weft.constrain.schema import DEFAULT_BASE_URI, resolve_document, subschemas, walk

_Anchors = dict[tuple[str, str], list[dict[str, Any]]]  # (document, name) -> the schemas naming it


def static_dynamic_refs(schema: Any) -> Any:
    """`schema` (rewritten in place, see the module doc), or as it was where a rewrite would not
    be exact."""
    if not isinstance(schema, dict):
        return schema
    anchors: _Anchors = {}
    refs: list[tuple[dict[str, Any], str]] = []
    bases: set[str] = set()
    _collect(schema, DEFAULT_BASE_URI, anchors, refs, bases)
    dynamic = Counter(
        node["$dynamicAnchor"] for nodes in anchors.values() for node in nodes
        if isinstance(node.get("$dynamicAnchor"), str)
    )  # fmt: skip
    if not dynamic and not refs or not _all_local(schema, {doc for doc, _ in anchors} | bases):
        return schema
    plain = [
        node
        for node, base in refs
        if "$ref" not in node and _is_plain(node["$dynamicRef"], base, anchors, dynamic)
    ]
    for node in plain:
        node["$ref"] = node.pop("$dynamicRef")
    if len(plain) == len(refs):
        _plain_anchors(schema, anchors)
    return schema


##### Internal Helper Functions #####


def _collect(
    node: Any,
    base: str,
    anchors: _Anchors,
    refs: list[tuple[dict[str, Any], str]],
    bases: set[str],
) -> None:
    """The anchors of every resource, each `$dynamicRef` with its base URI, the resources' URIs."""
    if not isinstance(node, dict):
        return
    if isinstance(node.get("$id"), str):
        base = resolve_document(base, node["$id"])
    bases.add(base)
    for key in ("$anchor", "$dynamicAnchor"):
        if isinstance(node.get(key), str):
            anchors.setdefault((base, node[key]), []).append(node)
    if "$dynamicRef" in node:
        refs.append((node, base))
    for sub in subschemas(node):
        _collect(sub, base, anchors, refs, bases)


def _all_local(schema: dict[str, Any], documents: set[str]) -> bool:
    """Whether every reference stays in `documents` (a remote one could enter the dynamic scope)."""
    ok = True

    def visit(node: Any, base: str) -> None:
        nonlocal ok
        if not isinstance(node, dict):
            return
        if isinstance(node.get("$id"), str):
            base = resolve_document(base, node["$id"])
        for key in ("$ref", "$dynamicRef"):
            if (
                isinstance(node.get(key), str)
                and resolve_document(base, node[key]) not in documents
            ):
                ok = False
        for sub in subschemas(node):
            visit(sub, base)

    visit(schema, DEFAULT_BASE_URI)
    return ok


def _is_plain(ref: Any, base: str, anchors: _Anchors, dynamic: Counter[str]) -> bool:
    """Whether the `$dynamicRef` `ref` (written under `base`) always resolves as a `$ref`."""
    if not isinstance(ref, str):
        return False
    fragment = ref.partition("#")[2]
    if fragment == "" or fragment.startswith("/"):
        return True
    targets = anchors.get((resolve_document(base, ref), fragment), [])
    if len(targets) != 1:
        return False  # NOTE: a document weft does not hold, or an ambiguous anchor
    return targets[0].get("$dynamicAnchor") != fragment or dynamic[fragment] == 1


def _plain_anchors(schema: dict[str, Any], anchors: _Anchors) -> None:
    """Every `$dynamicAnchor` as an `$anchor` (no `$dynamicRef` is left to read them)."""
    referred = {
        node[key].partition("#")[2]
        for node in walk(schema)
        for key in ("$ref", "$dynamicRef")
        if isinstance(node.get(key), str)
    }
    for (_, name), nodes in anchors.items():
        for node in nodes:
            if node.get("$dynamicAnchor") != name:
                continue
            if node.get("$anchor") == name:
                del node["$dynamicAnchor"]
            elif "$anchor" not in node and len(nodes) == 1:
                node["$anchor"] = node.pop("$dynamicAnchor")
            elif name not in referred:
                del node["$dynamicAnchor"]

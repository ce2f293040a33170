"""`unevaluatedProperties` / `unevaluatedItems` rewritten into `additionalProperties` / `items`
where what they see as evaluated is known in each case that decides it (draft 2020-12).

A schema's evaluated properties are those its `properties`, `patternProperties` and
`additionalProperties` cover, its own and those of every subschema applied in place to the same
instance whose annotations are kept. Through `allOf` and a local `$ref` that set is fixed (a valid
instance passes them all; `not` keeps no annotations). `anyOf`, `oneOf`, `if` and
`dependentSchemas` keep a subschema's annotations only where it holds, so the set is fixed in each
"world": which `anyOf` branches hold (each non-empty subset), which `oneOf` branch, whether `if`
holds, whether the dependent property is present. Each world is stated by conditions (the branches
that hold, the complements of those that do not: schema_negate.py), which leave the worlds
disjoint and together cover every instance the applicators let through.

`unevaluatedProperties: U` is then `anyOf` over the worlds of `allOf[conditions, {"properties":
<its names>, "patternProperties": <its patterns>, "additionalProperties": U}]`; an
`additionalProperties` or a nested `unevaluatedProperties` in a world leaves nothing unevaluated
there. Items alike: the longest `prefixItems`, and `items` or a nested `unevaluatedItems`
(everything). A complement that is not known, `contains` (items), a dynamic reference or more
than MAX_WORLDS worlds leaves the keyword as written.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from weft.constrain.schema import subschemas, walk
from weft.constrain.schema_negate import Schema, all_of, any_of, negate
from weft.constrain.schema_refs import resolve_pointer

PROPERTIES = "unevaluatedProperties"
ITEMS = "unevaluatedItems"
MAX_WORLDS = 16
MAX_BRANCHES = 3  # `anyOf` branches split into the subsets that hold (2^n - 1 worlds)
_Alternative = tuple[list[Schema], list[Any]]  # (conditions, subschemas whose annotations count)


def static_unevaluated(schema: Any) -> Any:
    """`schema` (rewritten in place) with every `unevaluatedProperties` / `unevaluatedItems` that
    can be rewritten as the module doc says; the others are left as written."""
    if not isinstance(schema, dict):
        return schema
    # a `$ref` is resolved only where no nested `$id` moves the base of its JSON pointer
    nested_ids = any("$id" in node for node in walk(schema) if node is not schema)
    _visit(schema, None if nested_ids else schema)
    return schema


##### Internal Helper Functions #####


@dataclass(frozen=True)
class _World:
    conditions: list[Schema]  # what tells this world from the others
    scope: list[dict[str, Any]]  # the schemas whose annotations count in it
    todo: list[Any]  # subschemas still to read
    refs: frozenset[str] = frozenset()
    everything: bool = False  # every property (item) is evaluated


def _visit(node: Any, root: dict[str, Any] | None) -> None:
    """Post-order: a nested `unevaluated*` is rewritten before the schemas that see it."""
    if not isinstance(node, dict):
        return
    for sub in list(subschemas(node)):
        _visit(sub, root)
    for keyword in (PROPERTIES, ITEMS):
        if keyword in node and isinstance(node[keyword], bool | dict):
            _rewrite(node, root, keyword)


def _rewrite(node: dict[str, Any], root: dict[str, Any] | None, keyword: str) -> None:
    value, last = node[keyword], "additionalProperties" if keyword == PROPERTIES else "items"
    worlds = _worlds(node, root, keyword)
    if worlds is None:
        return
    terms: list[Schema] = []
    for world in worlds:
        evaluated = None if world.everything else _evaluated(world.scope, keyword)
        rest: Schema = True if evaluated is None else {**evaluated, last: value}
        terms.append(all_of([*world.conditions, rest]))
    del node[keyword]
    conjunct = any_of(terms) if value is not True else True
    added = [] if conjunct is True else [conjunct]
    if not (isinstance(conjunct, dict) and last in conjunct):
        # NOTE: marks everything evaluated, for the schemas that see this one (_evaluates_all)
        added.insert(0, {last: True})
    node.setdefault("allOf", []).extend(added)


def _worlds(node: dict[str, Any], root: dict[str, Any] | None, keyword: str) -> list[_World] | None:
    """The worlds of the module doc for `node`'s `keyword`, or None."""
    pending, done = [_World([], [], [node])], []
    while pending:
        world = pending.pop()
        if world.everything or not world.todo:
            done.append(world)
            continue
        here, todo = world.todo[-1], world.todo[:-1]
        if isinstance(here, bool):
            pending.append(replace(world, todo=todo))
            continue
        if not isinstance(here, dict) or not _readable(here, keyword):
            return None
        if _evaluates_all(here, node, keyword):
            pending.append(replace(world, todo=[], everything=True))
            continue
        refs = world.refs
        todo = [*todo, *here.get("allOf", [])]
        if "$ref" in here:
            target = resolve_pointer(root, here["$ref"]) if root is not None else None
            if target is None or here["$ref"] in refs:
                return None
            refs, todo = refs | {here["$ref"]}, [*todo, target]
        splits = _splits(here)
        if splits is None:
            return None
        for combo in itertools.product(*splits):
            conditions = [*world.conditions, *(c for alt in combo for c in alt[0])]
            more = [s for alt in combo for s in alt[1]]
            pending.append(_World(conditions, [*world.scope, here], [*todo, *more], refs))
        if len(pending) + len(done) > MAX_WORLDS:
            return None
    return done


def _readable(schema: dict[str, Any], keyword: str) -> bool:
    """No keyword whose annotations cannot be told apart, and the shapes read here are right."""
    if {"$dynamicRef", "$recursiveRef"} & set(schema):
        return False
    if keyword == ITEMS and "contains" in schema:
        return False
    shapes = {"allOf": list, "properties": dict, "patternProperties": dict, "prefixItems": list}
    return all(isinstance(schema.get(key, kind()), kind) for key, kind in shapes.items())


def _evaluates_all(here: dict[str, Any], node: dict[str, Any], keyword: str) -> bool:
    """Whether `here` (or one of its `allOf` entries, as it always holds) evaluates everything."""
    last = "additionalProperties" if keyword == PROPERTIES else "items"
    entries = [e for e in here.get("allOf", []) if isinstance(e, dict)]
    return any(last in s or (s is not node and keyword in s) for s in [here, *entries])


def _splits(here: dict[str, Any]) -> list[list[_Alternative]] | None:
    """Per applicator of `here` that keeps annotations only where a subschema holds, its
    alternatives; None if a complement is not known (or a subschema must not be copied)."""
    out: list[list[_Alternative]] = []
    branches = here.get("anyOf")
    if isinstance(branches, list) and branches:
        inverses = _inverses(branches)
        if inverses is None or len(branches) > MAX_BRANCHES:
            return None
        subsets = itertools.chain.from_iterable(
            itertools.combinations(range(len(branches)), k) for k in range(1, len(branches) + 1)
        )
        out.append([_holding(branches, inverses, set(s)) for s in subsets])
    branches = here.get("oneOf")
    if isinstance(branches, list) and branches:
        inverses = _inverses(branches)
        if inverses is None:
            return None
        out.append([_holding(branches, inverses, {i}) for i in range(len(branches))])
    if "if" in here:
        inverse = _inverses([here["if"]])
        if inverse is None:
            return None
        then = [here["then"]] if "then" in here else []
        other = [here["else"]] if "else" in here else []
        out.append([([here["if"]], [here["if"], *then]), (inverse, other)])
    deps = here.get("dependentSchemas", {})
    if not isinstance(deps, dict):
        return None
    for name, sub in deps.items():
        out.append([([{"properties": {name: False}}], []), ([{"required": [name]}], [sub])])
    return out


def _inverses(branches: list[Any]) -> list[Schema] | None:
    """The complements of `branches` (None if one is not known, or has an `$id` or anchor, so
    that the branch itself must not be copied into a condition either)."""
    inverses = [negate(b) for b in branches]
    return None if any(i is None for i in inverses) else [i for i in inverses if i is not None]


def _holding(branches: list[Any], inverses: list[Schema], held: set[int]) -> _Alternative:
    """The world where exactly the branches `held` hold."""
    conditions = [b if i in held else inverses[i] for i, b in enumerate(branches)]
    return conditions, [b for i, b in enumerate(branches) if i in held]


def _evaluated(scope: list[dict[str, Any]], keyword: str) -> dict[str, Any]:
    """What `scope` evaluates: {properties, patternProperties} of names / patterns, or
    {prefixItems} as long as the longest."""
    if keyword == ITEMS:
        length = max((len(s.get("prefixItems", [])) for s in scope), default=0)
        return {"prefixItems": [True] * length} if length else {}
    names = {n: True for s in scope for n in s.get("properties", {})}
    patterns = {p: True for s in scope for p in s.get("patternProperties", {})}
    return {
        **({"properties": names} if names else {}),
        **({"patternProperties": patterns} if patterns else {}),
    }

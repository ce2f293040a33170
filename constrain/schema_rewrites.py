"""Exact rewrites of JSON-schema keywords llguidance does not enforce into keywords it does.

Each rewrite replaces a keyword by conjuncts (appended to the schema's `allOf`) that an instance
satisfies exactly when it satisfies the keyword (draft 2020-12), or leaves it as written:

- no-ops dropped: `uniqueItems: false`, `if` without `then`/`else` and `then`/`else` without
  `if`, `minContains`/`maxContains` without `contains`, `propertyNames: true`, empty
  dependencies;
- `not: S` -> the complement of S (schema_negate.py), where it is known;
- `if: I, then: T, else: E` -> `anyOf[not I, T]` and `anyOf[I, E]`;
- `dependentRequired: {p: qs}` -> `anyOf[{properties: {p: false}}, {required: qs}]`, and
  `dependentSchemas: {p: S}` -> `anyOf[{properties: {p: false}}, S]`;
- `propertyNames` of a name set (`const`/`enum`), one `pattern` or length bounds -> the names
  as `properties` / `patternProperties` with `additionalProperties: false`;
- `contains` where it counts nothing it cannot (`true`, `false`, `minContains: 0`, `maxContains:
  0`, `maxContains < minContains`);
- `uniqueItems` that holds trivially (`maxItems <= 1`) or over a small finite set of arrays;
- `oneOf` whose branches are pairwise disjoint -> `anyOf`; else, for a few branches with known
  complements, `anyOf` over "this branch and no other".

`unevaluated*` (schema_unevaluated.py) are rewritten first, while the annotations they read are
as written; const/enum spellings (schema_spellings.py) last. A keyword that a `$ref` points into
by JSON pointer is never moved, and nothing is rewritten under a dialect other than 2020-12.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from weft.constrain.schema import ANNOTATIONS, map_subschemas, walk
from weft.constrain.schema_dynamic import static_dynamic_refs
from weft.constrain.schema_negate import (
    ANY_CHAR,
    Schema,
    all_of,
    any_of,
    has_identity,
    negate,
    other_types,
)
from weft.constrain.schema_sets import disjoint, unique_arrays
from weft.constrain.schema_spellings import needs_respelling, respelled
from weft.constrain.schema_unevaluated import ITEMS, PROPERTIES, static_unevaluated

REWRITTEN = frozenset(
    "not if then else dependentRequired dependentSchemas propertyNames oneOf contains "
    f"minContains maxContains uniqueItems {PROPERTIES} {ITEMS}".split()
)
# the keywords that may call for a rewrite, or stop one
_READ = REWRITTEN | {"$dynamicRef", "$dynamicAnchor", "$ref", "$schema"}
_RESPELL = "const/enum"  # (in `found`) a value to respell
DIALECT = re.compile(r"https?://json-schema\.org/draft/2020-12/schema#?")
MAX_ONE_OF = 4  # oneOf branches rewritten through complements (each term holds n - 1 of them)
MAX_NAME_LENGTH = 256  # propertyNames length bounds written as a counted repetition


def exact_rewrites(schema: Any) -> Any:
    """A copy of `schema` with the module doc's rewrites; `schema` itself if none applies."""
    if not isinstance(schema, dict):
        return schema
    found: set[str] = set()
    for node in walk(schema):
        found.update(key for key in node if key in _READ)
        if needs_respelling(node):
            found.add(_RESPELL)
    if not found & {*REWRITTEN, "$dynamicRef", "$dynamicAnchor", _RESPELL}:
        return schema
    if "$schema" in found and not _plain_dialect(schema):
        return schema
    blocked = _pointed_into(schema) if found & {"$ref", "$dynamicRef"} else set()
    out = copy.deepcopy(schema)
    if found & {"$dynamicRef", "$dynamicAnchor"}:
        static_dynamic_refs(out)
    if found & {PROPERTIES, ITEMS} and not {PROPERTIES, ITEMS} & blocked:
        static_unevaluated(out)
    if found & REWRITTEN:
        out = _Rewriter(blocked).visit(out)
    if _RESPELL in found:
        respelled(out)
    return schema if out == schema else out


##### Internal Helper Functions #####


def _plain_dialect(schema: dict[str, Any]) -> bool:
    """Draft 2020-12 throughout: no `$schema` naming another dialect (or a custom meta-schema),
    at the root or below."""
    dialects = [node["$schema"] for node in walk(schema) if "$schema" in node]
    return all(isinstance(d, str) and DIALECT.fullmatch(d) for d in dialects)


def _pointed_into(schema: dict[str, Any]) -> set[str]:
    """The rewritten keywords that a `$ref` / `$dynamicRef` JSON pointer passes through."""
    found: set[str] = set()
    for node in walk(schema):
        for key in ("$ref", "$dynamicRef"):
            ref = node.get(key)
            if isinstance(ref, str) and "#/" in ref:
                parts = ref.partition("#")[2].split("/")
                found |= {p.replace("~1", "/").replace("~0", "~") for p in parts}
    return found & REWRITTEN


class _Rewriter:
    """The rewrites of one schema, children before parents (so `not` sees rewritten ones)."""

    def __init__(self, blocked: set[str]) -> None:
        self.blocked = blocked
        self.parked = 0

    def visit(self, node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        self._double_negation(node)
        map_subschemas(node, self.visit)
        if not isinstance(node.get("allOf", []), list):
            return node
        conjuncts: list[Schema] = []
        for rule in (
            self._no_ops,
            self._not,
            self._conditional,
            self._dependent_required,
            self._dependent_schemas,
            self._property_names,
            self._contains,
            self._unique_items,
            self._one_of,
        ):
            conjuncts += [c for c in rule(node) if c is not True and c != {}]
        if conjuncts:
            node.setdefault("allOf", []).extend(conjuncts)
        return node

    def _free(self, node: dict[str, Any], *keys: str) -> bool:
        """Whether all of `keys` are in `node` and none is pointed into."""
        return all(k in node for k in keys) and not self.blocked & set(keys)

    def _drop(self, node: dict[str, Any], key: str) -> None:
        """Remove `key`; a subschema a `$ref` may reach by `$id` or anchor is kept in `$defs`."""
        if not has_identity(node[key]):
            del node[key]
        elif isinstance(node.setdefault("$defs", {}), dict):
            node["$defs"][f"weft-parked-{self.parked}"] = node.pop(key)
            self.parked += 1

    def _double_negation(self, node: dict[str, Any]) -> None:
        """`not: {not: S}` is S (before S is rewritten, which its complement may not undo)."""
        inner = node.get("not")
        if self._free(node, "not") and isinstance(inner, dict) and set(inner) == {"not"}:
            if isinstance(node.get("allOf", []), list):
                del node["not"]
                node.setdefault("allOf", []).append(inner["not"])

    def _no_ops(self, node: dict[str, Any]) -> list[Schema]:
        if self._free(node, "uniqueItems") and node["uniqueItems"] is False:
            del node["uniqueItems"]
        if self._free(node, "if") and "then" not in node and "else" not in node:
            self._drop(node, "if")
        for key in ("then", "else"):
            if self._free(node, key) and "if" not in node:
                self._drop(node, key)
        for key in ("minContains", "maxContains"):
            if self._free(node, key) and "contains" not in node:
                del node[key]
        if self._free(node, "propertyNames") and node["propertyNames"] in (True, {}):
            del node["propertyNames"]
        return []

    def _not(self, node: dict[str, Any]) -> list[Schema]:
        if not self._free(node, "not"):
            return []
        inverse = negate(node["not"])
        if inverse is None:
            return []
        del node["not"]
        return [inverse]

    def _conditional(self, node: dict[str, Any]) -> list[Schema]:
        """(I -> T) and (not I -> E) is (not I or T) and (I or E)."""
        if not self._free(node, "if") or self.blocked & {"then", "else"}:
            return []
        cond, then, other = node["if"], node.get("then", True), node.get("else", True)
        out: list[Schema] = []
        if then is not True and then != {}:
            inverse = negate(cond)
            if inverse is None:
                return []
            out.append(any_of([inverse, then]))
        if other is not True and other != {}:
            out.append(any_of([cond, other]))
        for key in ("if", "then", "else"):
            node.pop(key, None)
        return out

    def _dependent_required(self, node: dict[str, Any]) -> list[Schema]:
        deps = node.get("dependentRequired")
        if not self._free(node, "dependentRequired") or not isinstance(deps, dict):
            return []
        if not all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in deps.values()
        ):
            return []
        del node["dependentRequired"]
        # NOTE: the library writes `required` keys first, in their order: the last branch (the
        # same values) lets `name` come before them
        return [
            any_of(
                [
                    {"properties": {name: False}},
                    {"required": needed},
                    {"required": list(dict.fromkeys([name, *needed]))},
                ]
            )
            for name, needed in deps.items()
            if needed
        ]

    def _dependent_schemas(self, node: dict[str, Any]) -> list[Schema]:
        deps = node.get("dependentSchemas")
        if not self._free(node, "dependentSchemas") or not isinstance(deps, dict):
            return []
        if not all(isinstance(v, bool | dict) for v in deps.values()):
            return []
        del node["dependentSchemas"]
        return [any_of([{"properties": {name: False}}, sub]) for name, sub in deps.items()]

    def _property_names(self, node: dict[str, Any]) -> list[Schema]:
        if not self._free(node, "propertyNames"):
            return []
        conjunct = _names_conjunct(node["propertyNames"])
        if conjunct is None:
            return []
        del node["propertyNames"]
        return [conjunct]

    def _contains(self, node: dict[str, Any]) -> list[Schema]:
        keys = ("contains", "minContains", "maxContains")
        if not self._free(node, "contains") or self.blocked & set(keys):
            return []
        found, low, high = node["contains"], node.get("minContains", 1), node.get("maxContains")
        if not _count(low) or not (high is None or _count(high)) or has_identity(found):
            return []
        out: list[Schema]
        if high is not None and high < low:
            out = other_types("array")  # no array has that many and that few
        elif low == 0 and high is None or found is False and low == 0:
            out = []  # counts nothing
        elif found is True or found == {}:
            out = [{"minItems": low, **({"maxItems": high} if high is not None else {})}]
        elif found is False:
            out = other_types("array")
        elif low == 0 and high == 0 and (inverse := negate(found)) is not None:
            out = [{"items": inverse}]
        else:
            return []
        for key in keys:
            node.pop(key, None)
        return [any_of(out)] if out else []

    def _unique_items(self, node: dict[str, Any]) -> list[Schema]:
        if not self._free(node, "uniqueItems") or node["uniqueItems"] is not True:
            return []
        if _count(node.get("maxItems")) and node["maxItems"] <= 1:
            del node["uniqueItems"]
            return []
        arrays = unique_arrays(node)
        if arrays is None:
            return []
        del node["uniqueItems"]
        return [any_of([*other_types("array"), {"enum": arrays} if arrays else False])]

    def _one_of(self, node: dict[str, Any]) -> list[Schema]:
        branches = node.get("oneOf")
        if not self._free(node, "oneOf") or not isinstance(branches, list) or not branches:
            return []
        if disjoint(branches, node.get("type")):
            del node["oneOf"]
            return [any_of(branches)]
        if len(branches) > MAX_ONE_OF:
            return []
        inverses = [negate(b) for b in branches]
        if any(inverse is None for inverse in inverses):
            return []
        terms: list[Schema] = []
        for i, branch in enumerate(branches):
            others = [inv for j, inv in enumerate(inverses) if j != i and inv is not None]
            terms.append(all_of([branch, *others]))
        del node["oneOf"]
        return [any_of(terms)]


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _names_conjunct(names: Any) -> Schema | None:
    """Objects whose property names all satisfy `names`, where that is a name set, one pattern
    or length bounds; None otherwise."""
    if names is True or names == {}:
        return True
    nothing: dict[str, Any] = {"additionalProperties": False}
    if names is False:
        return nothing
    if not isinstance(names, dict) or has_identity(names):
        return None
    keys = {k for k in names if k not in ANNOTATIONS and not k.startswith("x-")}
    kinds = names.get("type", "string")
    if "type" in keys:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list):
            return None
        if "string" not in kinds:
            return nothing
        keys.discard("type")
    if not keys:
        return True
    if keys in ({"const"}, {"enum"}):
        values = [names["const"]] if "const" in names else names["enum"]
        if not isinstance(values, list):
            return None
        words = [v for v in values if isinstance(v, str)]
        return {"properties": dict.fromkeys(words, True), **nothing} if words else nothing
    if keys == {"pattern"} and isinstance(names["pattern"], str):
        return {"patternProperties": {names["pattern"]: True}, **nothing}
    if keys and keys <= {"minLength", "maxLength"}:
        low, high = names.get("minLength", 0), names.get("maxLength")
        if not _count(low) or not (high is None or _count(high) and low <= high <= MAX_NAME_LENGTH):
            return None
        if low > MAX_NAME_LENGTH:
            return None
        bounds = f"{{{low},{'' if high is None else high}}}"
        return {"patternProperties": {f"^{ANY_CHAR}{bounds}$": True}, **nothing}
    return None

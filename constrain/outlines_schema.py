"""The outlines backend's JSON-schema policy: a schema rewritten into the part of JSON Schema that
outlines-core's `build_regex_from_schema` translates exactly; what that part cannot hold left to
the output validation (reported; refused if strict); what no regex can follow, refused.

outlines-core reads one keyword per schema object (`properties`, else `allOf`, `anyOf`, `oneOf`,
`prefixItems`, `enum`, `const`, `$ref`, `type`) and drops the rest, closes objects, unrolls
recursion, and writes its own loose `format`s. So weft hands it only schemas built from: `type`
(null, boolean, integer, number); strings as a `pattern` over their JSON text (outlines_text.py:
patterns, weft's formats, lengths); closed objects (`properties` + `required`,
`additionalProperties: false`) or maps (`additionalProperties` only); arrays (`items` with
`minItems`/`maxItems`) or tuples (`prefixItems`); `const`; `anyOf`.

The rewrite works on conjuncts: every schema a value must match at one place (the subschema, its
`$ref` targets, `allOf` entries, `if` with a boolean condition). `anyOf` and `oneOf` are
distributed into alternatives, `dependentRequired` / `dependentSchemas` split on whether the
property is present. A finite set of values (`enum`, `const`, null, booleans, integers between
close bounds) is listed after validating each against every conjunct as written (jsonschema, as
validation.py), so every keyword holds exactly for them.

Refused in every mode (a grammar that blocks valid values is a wrong decision): any value
without a `type` or items / properties that bound it (a regex cannot nest without bound), objects
that allow undeclared properties next to declared ones, recursive `$ref`s, `prefixItems` followed
by unboundedly many items. Object properties come in schema order, numbers as outlines-core
writes them (exponents with a sign), strings raw (no `\\u` escapes but of control characters).
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from dataclasses import dataclass, field, replace
from typing import Any

from weft.constrain.errors import GrammarError
from weft.constrain.formats import INEXACT_FORMATS, LOOSE_TIME_FORMATS
from weft.constrain.outlines_alternatives import (
    Branch,
    disjoint,
    distinct,
    value_schemas,
)
from weft.constrain.outlines_containers import (
    Conjunct,
    count,
    escape,
    keywords,
    lower_array,
    lower_object,
    one_of,
)
from weft.constrain.outlines_text import PatternError, format_body, length_body, pattern_body
from weft.constrain.schema_paths import walk_pointers
from weft.constrain.schema_refs import resolve_pointer
from weft.constrain.schema_sets import json_type
from weft.constrain.validation import schema_validator

TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
MAX_STEPS = 4096  # conjunct lists rewritten for one schema
MAX_LISTED = 64  # integers listed one by one between bounds
# time formats whose exact regex (leap seconds only at 23:59 UTC: ~2900 offsets) outlines-core
# takes 8-15 s to index: a leap second is allowed at any time, and the format reported
LOOSE_FORMATS = LOOSE_TIME_FORMATS
_LOOSE_WHY = "a leap second is allowed at any time of day"


@dataclass
class Rewritten:
    """A schema for outlines-core and the keywords it leaves unenforced (keyword -> (JSON pointer
    of its first use, why; "" if plain))."""

    schema: Any
    unenforced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def located(self) -> str:
        """The unenforced keywords as `name (why; at #/pointer)`, for a refusal."""
        return ", ".join(
            f"{name} ({why + '; ' if why else ''}at #{pointer})"
            for name, (pointer, why) in self.unenforced.items()
        )


##### Public API #####


def outlines_schema(schema: Any) -> Rewritten:
    """`schema` rewritten for outlines-core (see the module doc); GrammarError if refused."""
    try:
        return _Rewriter(schema).run()
    except RecursionError:
        raise GrammarError("json_schema nests too deeply for the outlines backend") from None


class _Rewriter:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.unenforced: dict[str, tuple[str, str]] = {}
        self.steps = 0
        self._validator = schema_validator(json.dumps(root))
        dialect = root.get("$schema") if isinstance(root, dict) else None
        # draft 7 and older: $ref ignores its siblings; `dependencies`, not `dependent*`
        self._old_draft = isinstance(dialect, str) and bool(re.search(r"draft-0[3-7]", dialect))
        self._dependency_keywords = (
            ("dependencies",) if self._old_draft else ("dependentRequired", "dependentSchemas")
        )
        nodes = list(walk_pointers(root))
        self._nested_ids = any("$id" in node for ptr, node in nodes if ptr)
        anchors: dict[str, str | None] = {}
        for ptr, node in nodes:
            for key in ("$anchor", "$dynamicAnchor"):
                name = node.get(key)
                if isinstance(name, str):
                    anchors[name] = None if anchors.get(name, ptr) != ptr else ptr
        self._anchors = anchors

    def run(self) -> Rewritten:
        alternatives = self.lower([Conjunct("", self.root, self.root, frozenset({""}))])
        if not alternatives:
            raise GrammarError("the schema matches no value: there is nothing to generate")
        return Rewritten(one_of(alternatives), self.unenforced)

    ##### Used by outlines_containers #####

    def lower(self, conjuncts: list[Conjunct]) -> list[Any]:
        """The alternatives (outlines-core schemas) of the values that match every conjunct."""
        expanded = self._expand(conjuncts)
        return [] if expanded is None else self._lower(expanded)

    def skip(self, keyword: str, pointer: str, why: str = "") -> None:
        self.unenforced.setdefault(keyword, (pointer, why))

    def valid(self, schema: Any, value: Any) -> bool:
        try:
            return bool(self._validator.evolve(schema=schema).is_valid(value))
        except Exception as e:  # NOTE: e.g. an unresolvable $ref: the values cannot be listed
            raise GrammarError(f"the outlines backend cannot check values against it: {e}") from e

    ##### Conjuncts #####

    def _expand(self, conjuncts: list[Conjunct]) -> list[Conjunct] | None:
        """`conjuncts` with their `$ref` targets, `allOf` entries and decided `if`s added; None if
        one is `false`."""
        out: list[Conjunct] = []
        todo = list(conjuncts)
        while todo:
            c = todo.pop(0)
            if c.node is True:
                continue
            if c.node is False:
                return None
            if not isinstance(c.node, dict):
                raise GrammarError(
                    f"invalid json_schema: a schema is an object or a boolean (#{c.pointer})"
                )
            out.append(c)
            node = c.node
            if isinstance(node.get("$ref"), str):
                target = self._resolve(node["$ref"], c)
                if target is not None:
                    todo.append(target)
                if self._old_draft:
                    out[-1] = replace(c, node={})
                    continue
            for i, sub in enumerate(node.get("allOf") or []):
                todo.append(Conjunct(f"{c.pointer}/allOf/{i}", sub, sub, c.refs))
            for key in ("$dynamicRef", "$recursiveRef"):
                if key in node:
                    self.skip(key, f"{c.pointer}/{key}")
            cond = node.get("if")
            branch = "then" if cond is True or cond == {} else "else" if cond is False else None
            if branch in node:
                todo.append(Conjunct(f"{c.pointer}/{branch}", node[branch], node[branch], c.refs))
            inner = node.get("not")
            if isinstance(inner, dict) and set(keywords(inner)) == {"not"}:
                todo.append(Conjunct(f"{c.pointer}/not/not", inner["not"], inner["not"], c.refs))
        if not out and conjuncts:  # only `true`s: one empty conjunct keeps the place
            first = conjuncts[0]
            out.append(Conjunct(first.pointer, {}, True, first.refs))
        return out

    def _resolve(self, ref: str, c: Conjunct) -> Conjunct | None:
        """The conjunct `ref` names; None for a document weft never fetches (reported)."""
        where = f"{c.pointer}/$ref"
        base, _, fragment = ref.partition("#")
        root_id = self.root.get("$id") if isinstance(self.root, dict) else None
        if base and not (
            isinstance(root_id, str) and urllib.parse.urljoin(root_id, base) == root_id
        ):
            self.skip(f"$ref:{base}", where, "weft does not fetch referenced documents")
            return None
        if self._nested_ids:
            raise GrammarError(
                "the outlines backend resolves $ref only in a schema without nested $id "
                f"(at #{where})"
            )
        fragment = urllib.parse.unquote(fragment)
        pointer = (
            fragment if not fragment or fragment.startswith("/") else self._anchors.get(fragment)
        )
        node = None if pointer is None else resolve_pointer(self.root, f"#{pointer}")
        if pointer is None or node is None:
            raise GrammarError(f"$ref {ref!r} does not resolve (at #{where})")
        if pointer in c.refs:
            raise GrammarError(
                f"recursive $ref is not supported by the outlines backend (at #{where}: a regex "
                "cannot nest without bound); use the llguidance backend"
            )
        return Conjunct(pointer, node, node, c.refs | {pointer})

    def _lower(self, cs: list[Conjunct]) -> list[Any]:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise GrammarError("json_schema is too complex for the outlines backend")
        finite = next((c for c in cs if "const" in c.node or "enum" in c.node), None)
        if finite is not None:
            node = finite.node
            values = [node["const"]] if "const" in node else node["enum"]
            if not isinstance(values, list):
                raise GrammarError(f"invalid json_schema: enum is a list (#{finite.pointer})")
            return self._values(values, cs)
        for c in cs:
            for key in ("anyOf", "oneOf"):
                if isinstance(c.node.get(key), list):
                    return self._distribute(c, key, cs)
            for key in self._dependency_keywords:
                if isinstance(c.node.get(key), dict) and c.node[key]:
                    return self._split(c, key, cs)
        alternatives: list[Any] = []
        types, pending = self._types(cs)
        for kind in types:
            if kind in ("null", "boolean"):
                alternatives += self._values([None] if kind == "null" else [False, True], cs)
                continue
            if kind in ("integer", "number"):
                found = self._number(kind, cs)
            elif kind == "string":
                found = self._string(cs)
            else:
                found = (lower_array if kind == "array" else lower_object)(self, cs)
            if found and not all("const" in a for a in found):
                for keyword, pointer in pending:
                    self.skip(keyword, pointer)
            alternatives += found
        return distinct(alternatives)

    def _values(self, values: list[Any], cs: list[Conjunct]) -> list[Any]:
        kept = [v for v in values if all(self.valid(c.check, v) for c in cs)]
        return distinct([a for v in kept for a in value_schemas(v, cs[0].pointer)])

    def _distribute(self, c: Conjunct, key: str, cs: list[Conjunct]) -> list[Any]:
        """anyOf / oneOf: the union of the alternatives of each entry with the other conjuncts
        (oneOf: reported unless its entries' alternatives cannot overlap)."""
        rest = replace(c, node={k: v for k, v in c.node.items() if k != key})
        others = [rest if x is c else x for x in cs]
        branches = []
        for i, sub in enumerate(c.node[key]):
            extra = self._expand([Conjunct(f"{c.pointer}/{key}/{i}", sub, sub, c.refs)])
            if extra is not None:
                branch = others + extra
                branches.append(Branch(self._lower(branch), *self._kinds(branch)))
        if key == "oneOf" and not disjoint(branches):
            self.skip("oneOf", f"{c.pointer}/oneOf", "its entries may overlap")
        return distinct([a for b in branches for a in b.alternatives])

    def _kinds(self, cs: list[Conjunct]) -> tuple[frozenset[str], bool]:
        """(the types the values of `cs` may have, whether they are listed: enum / const)."""
        finite = next((c for c in cs if "const" in c.node or "enum" in c.node), None)
        if finite is None:
            return frozenset(self._types(cs)[0]), False
        values = [finite.node["const"]] if "const" in finite.node else finite.node["enum"]
        return frozenset(json_type(v) for v in values), True

    def _split(self, c: Conjunct, key: str, cs: list[Conjunct]) -> list[Any]:
        """A dependency on a property: the alternatives without it, and those with it present
        and the dependency met (exact: the two cannot overlap)."""
        deps = c.node[key]
        trigger = next(iter(deps))
        remaining = {k: v for k, v in deps.items() if k != trigger}
        node = {k: v for k, v in c.node.items() if k != key} | (
            {key: remaining} if remaining else {}
        )
        others = [replace(c, node=node) if x is c else x for x in cs]
        where = f"{c.pointer}/{key}/{escape(trigger)}"
        dep = deps[trigger]
        absent = Conjunct(where, {"properties": {trigger: False}}, True, c.refs)
        present = [
            Conjunct(
                where,
                {"required": [trigger, *(dep if isinstance(dep, list) else [])]},
                True,
                c.refs,
            )
        ]
        extra = [] if isinstance(dep, list) else self._expand([Conjunct(where, dep, dep, c.refs)])
        out = self._lower(others + [absent])
        if extra is not None:
            out += self._lower(others + present + extra)
        return distinct(out)

    ##### Types #####

    def _types(self, cs: list[Conjunct]) -> tuple[list[str], list[tuple[str, str]]]:
        """The types a value may have, and the keywords that hold exactly only for listed values
        (`not`, `if`)."""
        allowed = set(TYPES)
        pending: list[tuple[str, str]] = []
        for c in cs:
            node = c.node
            if "type" in node:
                names = set(node["type"] if isinstance(node["type"], list) else [node["type"]])
                allowed &= names | ({"integer"} if "number" in names else set())
            if (
                "if" in node
                and node["if"] not in (True, False, {})
                and ("then" in node or "else" in node)
            ):
                pending.append(("if", f"{c.pointer}/if"))
            if "not" not in node or node["not"] is False:
                continue
            inner = node["not"]
            words = keywords(inner)
            if not words:
                return [], []
            if set(words) == {"not"}:
                continue  # a double negation: expanded
            if set(words) == {"type"}:
                names = set(inner["type"] if isinstance(inner["type"], list) else [inner["type"]])
                if "integer" in names and "number" not in names and "number" in allowed:
                    pending.append(("not", f"{c.pointer}/not"))
                allowed -= names | ({"integer"} if "number" in names else set())
            else:
                pending.append(("not", f"{c.pointer}/not"))
        if "number" in allowed:
            allowed.discard("integer")
        return [t for t in TYPES if t in allowed], pending

    def _number(self, kind: str, cs: list[Conjunct]) -> list[Any]:
        multiples = [c.node["multipleOf"] for c in cs if _is_number(c.node.get("multipleOf"))]
        integral = kind == "integer" or any(float(m).is_integer() for m in multiples)
        low, high = -math.inf, math.inf
        for c in cs:
            for key in ("minimum", "exclusiveMinimum"):
                if _is_number(c.node.get(key)):
                    low = max(low, c.node[key])
            for key in ("maximum", "exclusiveMaximum"):
                if _is_number(c.node.get(key)):
                    high = min(high, c.node[key])
        if integral and math.isfinite(low) and math.isfinite(high):
            first, last = math.ceil(low), math.floor(high)
            if last - first < MAX_LISTED:
                return self._values(list(range(first, last + 1)), cs)
        for c in cs:
            for key in NUMBER_KEYWORDS:
                if key in c.node and not (key == "multipleOf" and integral and c.node[key] == 1):
                    self.skip(key, f"{c.pointer}/{key}")
        return [{"type": "integer" if integral else "number"}]

    def _string(self, cs: list[Conjunct]) -> list[Any]:
        low = max((count(c, "minLength") for c in cs if "minLength" in c.node), default=0)
        highs = [count(c, "maxLength") for c in cs if "maxLength" in c.node]
        high = min(highs) if highs else None
        if high is not None and low > high:
            return []
        shapes: dict[str, tuple[str, str]] = {}  # body -> (keyword, pointer)
        for c in cs:
            pattern, name = c.node.get("pattern"), c.node.get("format")
            if isinstance(pattern, str):
                where = f"{c.pointer}/pattern"
                try:
                    shapes.setdefault(pattern_body(pattern), ("pattern", where))
                except PatternError as e:
                    if not e.readable:  # NOTE: the output validation cannot read it either
                        raise GrammarError(f"pattern {pattern!r} (at #{where}): {e}") from None
                    self.skip("pattern", where, f"{pattern!r}: {e}")
            if isinstance(name, str):
                where, keyword = f"{c.pointer}/format", f"format:{name}"
                if name in LOOSE_FORMATS:
                    shapes.setdefault(pattern_body(f"^{LOOSE_FORMATS[name]}$"), (keyword, where))
                    self.skip(keyword, where, _LOOSE_WHY)
                elif (body := format_body(name)) is not None:
                    shapes.setdefault(body, (keyword, where))
                    if name in INEXACT_FORMATS:
                        self.skip(keyword, where, INEXACT_FORMATS[name])
                else:
                    self.skip(keyword, where, "weft does not enforce this format")
        if not shapes:
            return [{"type": "string", "pattern": f"^{length_body(low, high)}$"}]
        body, *others = shapes
        for other in others:
            self.skip(*shapes[other], "only one pattern or format is enforced per string")
        if low or high is not None:
            for c in cs:
                for key in ("minLength", "maxLength"):
                    if key in c.node:
                        self.skip(key, f"{c.pointer}/{key}", "next to a pattern or format")
        return [{"type": "string", "pattern": f"^{body}$"}]


##### Internal Helper Functions #####


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)

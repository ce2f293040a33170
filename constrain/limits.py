"""GrammarLimits: what a grammar spec may ask of a backend, checked before it is compiled (a
GrammarError naming the limit and the number, an HTTP 400), so that no spec reaches a library
limit that would fail it mid-generation or a recursion that could take the process down."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from weft.constrain.errors import GrammarError
from weft.constrain.regex_text import lark_regexes, lark_repeats, regex_size


@dataclass(frozen=True)
class GrammarLimits:
    """Limits of one grammar spec. The defaults stay well inside what llguidance steps through
    (it fails a step at `a{1000000}`: "too many expressions"; a counted repetition of 10,000 or
    100,000 expanded items costs at most ~0.5 s of mask work) and inside Python's recursion limit
    (JSON nesting; llguidance's own JSON parser stops at 128 levels)."""

    max_regex_chars: int = 100_000  # a regex (a request's, a schema's pattern, a tag's)
    max_grammar_chars: int = (
        1_000_000  # the text of a JSON schema, an EBNF grammar, a structural tag
    )
    max_repeat: int = 10_000  # a counted repetition's bound: {n}, {n,m}, Lark's ~ n..m, repeat max
    max_expanded: int = 100_000  # a regex's items with counted repetitions expanded
    max_json_depth: int = 128  # nesting of a JSON schema's (or structural tag's) objects and arrays
    max_choices: int = 10_000  # items of a choices list

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GrammarLimits.{name} must be a positive integer, got {value!r}")

    ##### Public API #####

    def check(self, kind: str, text: str) -> None:
        """Refuse a spec (a GrammarSpec's kind and canonical text) beyond a limit."""
        if kind == "regex":
            self.check_regex(text, "regex")
        elif kind == "json_schema":
            self.check_json_text(text, "json_schema")
            self.check_schema(json.loads(text), "json_schema")
        elif kind == "ebnf":
            self._check_chars(text, self.max_grammar_chars, "ebnf grammar", "max_grammar_chars")
            self.check_lark(text, "ebnf grammar")
        elif kind == "choices":
            items = json.loads(text)
            self._check_chars(text, self.max_grammar_chars, "choices", "max_grammar_chars")
            if len(items) > self.max_choices:
                raise _refusal(f"choices has {len(items)} items", self.max_choices, "max_choices")
        elif kind == "structural_tag":
            self.check_json_text(text, "structural_tag")
            self._check_structural(json.loads(text))

    def check_json_text(self, text: str, what: str) -> None:
        """Size and nesting of JSON text, read without recursion (before json.loads reads it)."""
        self._check_chars(text, self.max_grammar_chars, what, "max_grammar_chars")
        depth = json_depth(text)
        if depth > self.max_json_depth:
            raise _refusal(
                f"{what} nests {depth} levels deep", self.max_json_depth, "max_json_depth"
            )

    def check_json_value(self, value: Any, what: str) -> None:
        """Nesting of a parsed JSON value (a request's object), read without recursion."""
        depth = value_depth(value)
        if depth > self.max_json_depth:
            raise _refusal(
                f"{what} nests {depth} levels deep", self.max_json_depth, "max_json_depth"
            )

    def check_regex(self, pattern: str, what: str) -> None:
        self._check_chars(pattern, self.max_regex_chars, what, "max_regex_chars")
        size = regex_size(pattern)
        if size.max_repeat > self.max_repeat:
            why = f"{what} has a repetition count of {size.max_repeat}"
            raise _refusal(why, self.max_repeat, "max_repeat")
        if size.expanded > self.max_expanded:
            why = f"{what} expands to {size.expanded} items (counted repetitions multiplied out)"
            raise _refusal(why, self.max_expanded, "max_expanded")

    def check_lark(self, grammar: str, what: str) -> None:
        """An EBNF (Lark or GBNF) grammar: its counted repetitions and its regex literals."""
        for count in lark_repeats(grammar):
            if count > self.max_repeat:
                why = f"{what} has a repetition count of {count}"
                raise _refusal(why, self.max_repeat, "max_repeat")
        for start, end in lark_regexes(grammar):
            self.check_regex(grammar[start:end], f"{what} regex /{grammar[start:end][:40]}/")

    def check_schema(self, schema: Any, what: str) -> None:
        """The regexes of a parsed JSON schema (`pattern`, `patternProperties` keys)."""
        for pattern in schema_patterns(schema):
            self.check_regex(pattern, f"{what} pattern {pattern[:40]!r}")

    ##### Internal Helper Functions #####

    def _check_structural(self, body: Any) -> None:
        """Every part of a structural tag: schemas, regexes, grammars, repeat bounds."""
        for node in _json_nodes(body):
            kind = node.get("type")
            if "schema" in node and isinstance(node["schema"], dict):  # older form's structures
                self.check_schema(node["schema"], "structural_tag schema")
            if kind == "json_schema":
                self.check_schema(node.get("json_schema"), "structural_tag json_schema")
            elif kind == "regex" and isinstance(node.get("pattern"), str):
                self.check_regex(node["pattern"], "structural_tag regex")
            elif kind == "grammar" and isinstance(node.get("grammar"), str):
                self.check_lark(node["grammar"], "structural_tag grammar")
            elif kind == "repeat":
                for key in ("min", "max"):
                    if isinstance(node.get(key), int) and node[key] > self.max_repeat:
                        why = f"structural_tag repeat {key} is {node[key]}"
                        raise _refusal(why, self.max_repeat, "max_repeat")

    def _check_chars(self, text: str, limit: int, what: str, name: str) -> None:
        if len(text) > limit:
            raise _refusal(f"{what} is too long ({len(text)} characters)", limit, name)


DEFAULT_LIMITS = GrammarLimits()

_JSON_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON text (strings skipped; no recursion)."""
    depth = deepest = 0
    for m in _JSON_BRACKETS.finditer(text):
        ch = m.group()
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def value_depth(value: Any) -> int:
    """The deepest nesting of dicts and lists in a parsed JSON value (no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((sub, depth + 1) for sub in item)
    return deepest


def schema_patterns(schema: Any) -> Iterator[str]:
    """Every regex of a schema: string `pattern`s and `patternProperties` keys, at any depth."""
    for node in _json_nodes(schema):
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            yield pattern
        props = node.get("patternProperties")
        if isinstance(props, dict):
            yield from props


def _json_nodes(value: Any) -> Iterator[dict[str, Any]]:
    """Every object in a parsed JSON value, without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _refusal(why: str, limit: int, name: str) -> GrammarError:
    return GrammarError(f"{why}; the limit is {limit} (grammar limit {name})")

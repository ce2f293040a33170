"""GrammarSpec: what a request asks for (JSON schema, regex, EBNF, choices, structural tag), in
canonical text."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from weft.constrain.errors import GrammarError
from weft.constrain.limits import DEFAULT_LIMITS
from weft.constrain.structural_tag import canonical_structural_tag

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "choices", "structural_tag"]


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asks for, in canonical text (the cache key).

    `json_schema`: the schema as compact JSON, key order kept (both backends emit object
    properties in schema order, so reordering keys would change the grammar). `choices`: a JSON
    list of strings. `json_object`: any JSON object (spec is ""). `regex`/`ebnf`: the text as given.
    `structural_tag`: SGLang's structures + triggers, or xgrammar's format, as compact JSON.
    `strict` (json_schema and structural_tag; OpenAI's `strict: true`): refuse the spec if the
    backend cannot enforce one of its schema keywords, as the backend-wide `strict` does for all.
    """

    kind: GrammarKind
    spec: str
    strict: bool = False

    def __post_init__(self) -> None:
        if self.kind not in get_args(GrammarKind):
            raise GrammarError(f"unknown grammar kind {self.kind!r}")
        if self.strict and self.kind not in ("json_schema", "structural_tag"):
            raise GrammarError(f"strict applies to json_schema and structural_tag, not {self.kind}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str, strict: bool = False) -> GrammarSpec:
        if isinstance(schema, str):
            DEFAULT_LIMITS.check_json_text(schema, "json_schema")  # before json.loads recurses
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        else:
            DEFAULT_LIMITS.check_json_value(schema, "json_schema")
        if schema is False:
            raise GrammarError("the json_schema false allows no value")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError("json_schema must be a JSON object (or a boolean schema)")
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except RecursionError:
            raise GrammarError("json_schema nests too deeply to read") from None
        return cls("json_schema", text, strict)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls("ebnf", grammar)

    @classmethod
    def structural_tag(cls, tag: dict[str, Any] | str, strict: bool = False) -> GrammarSpec:
        return cls("structural_tag", canonical_structural_tag(tag), strict)

    @classmethod
    def choices(cls, items: Sequence[str]) -> GrammarSpec:
        if isinstance(items, str) or not items or not all(isinstance(c, str) for c in items):
            raise GrammarError("choices must be a non-empty list of strings")
        return cls("choices", json.dumps(list(items), ensure_ascii=False))

    def choice_list(self) -> list[str]:
        assert self.kind == "choices"
        items: list[str] = json.loads(self.spec)
        return items

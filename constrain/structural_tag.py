"""SGLang's `structural_tag`, checked and made canonical: free text in which each trigger opens a
tag (its begin, a JSON value of its schema, its end); xgrammar's newer `format` form too.

The older shape (SGLang's and vLLM's `response_format`, native `sampling_params.structural_tag`):
`{"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`.
Every structure's begin starts with one of the triggers. The text outside tags never contains a
trigger: once one appears, a tag whose begin starts with it must follow, then its schema's value,
then its end; after that the text is free again. The grammar may end wherever the text is free.
It is the newer form's `triggered_tags` of `json_schema` contents (structural_format writes both).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weft.constrain.errors import GrammarError
from weft.constrain.limits import DEFAULT_LIMITS
from weft.constrain.structural_check import check_format, nested_triggers

FIELDS = ("structures", "triggers")
STRUCTURE_FIELDS = ("begin", "schema", "end")


@dataclass(frozen=True)
class Structure:
    begin: str  # starts with one of the triggers
    schema: dict[str, Any]  # the value between begin and end (a missing schema: any JSON value)
    end: str  # may be empty


@dataclass(frozen=True)
class StructuralTag:
    structures: tuple[Structure, ...]
    triggers: tuple[str, ...]

    ##### Public API #####

    @classmethod
    def parse(cls, value: Any) -> StructuralTag:
        """From the request's (decoded) object; a GrammarError says what is wrong."""
        if not isinstance(value, Mapping):
            raise GrammarError("structural_tag must be an object with structures and triggers")
        if value.get("type", "structural_tag") != "structural_tag":
            raise GrammarError(
                f"structural_tag type must be 'structural_tag', not {value['type']!r}"
            )
        _no_other_fields("structural_tag", value, ("type", *FIELDS))
        triggers = _triggers(value.get("triggers"))
        items = value.get("structures")
        if not isinstance(items, list) or not items:
            raise GrammarError("structural_tag.structures must be a non-empty list")
        structures = tuple(_structure(i, s, triggers) for i, s in enumerate(items))
        for t in triggers:
            if not any(s.begin.startswith(t) for s in structures):
                raise GrammarError(f"structural_tag trigger {t!r} begins no structure")
        return cls(structures, triggers)

    def canonical(self) -> str:
        """Compact JSON, order kept: the cache key, and what `parse` reads back."""
        body = {
            "structures": [
                {"begin": s.begin, "schema": s.schema, "end": s.end} for s in self.structures
            ],
            "triggers": list(self.triggers),
        }
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False)

    def as_format(self) -> dict[str, Any]:
        """The same constraint as xgrammar's newer form: triggered tags of JSON values."""
        tags = [
            {
                "begin": s.begin,
                "content": {"type": "json_schema", "json_schema": s.schema},
                "end": s.end,
            }
            for s in self.structures
        ]
        return {"type": "triggered_tags", "triggers": list(self.triggers), "tags": tags}


def canonical_structural_tag(value: Any) -> str:
    """The canonical JSON of a request's structural_tag (object or JSON text), either form:
    `{"structures", "triggers"}` or `{"format"}`. A GrammarError says what is wrong."""
    if isinstance(value, str):
        DEFAULT_LIMITS.check_json_text(value, "structural_tag")  # before json.loads recurses
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"structural_tag is not valid JSON: {e}") from None
    else:
        DEFAULT_LIMITS.check_json_value(value, "structural_tag")  # before the checks recurse
    if isinstance(value, Mapping) and "format" in value:
        if value.get("type", "structural_tag") != "structural_tag":
            raise GrammarError(
                f"structural_tag type must be 'structural_tag', not {value['type']!r}"
            )
        _no_other_fields("structural_tag", value, ("type", "format"))
        check_format(value["format"])
        return json.dumps({"format": value["format"]}, separators=(",", ":"), ensure_ascii=False)
    return StructuralTag.parse(value).canonical()


def structural_tag_format(canonical: str) -> dict[str, Any]:
    """The format tree of a canonical structural_tag (the older form as triggered_tags)."""
    body = json.loads(canonical)
    if "format" in body:
        tree: dict[str, Any] = body["format"]
        return tree
    return StructuralTag.parse(body).as_format()


##### Internal Helper Functions #####


def _no_other_fields(where: str, value: Mapping[str, Any], known: tuple[str, ...]) -> None:
    other = sorted(set(value) - set(known))
    if other:
        raise GrammarError(f"{where} has unknown field(s) {other}; known: {', '.join(known)}")


def _triggers(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise GrammarError("structural_tag.triggers must be a non-empty list of strings")
    if not all(isinstance(t, str) and t for t in value):
        raise GrammarError("structural_tag.triggers must be non-empty strings")
    triggers = tuple(dict.fromkeys(value))
    nested_triggers(triggers, "structural_tag.triggers")
    return triggers


def _structure(i: int, value: Any, triggers: tuple[str, ...]) -> Structure:
    where = f"structural_tag.structures[{i}]"
    if not isinstance(value, Mapping):
        raise GrammarError(f"{where} must be an object with begin, schema and end")
    _no_other_fields(where, value, STRUCTURE_FIELDS)
    begin, end, schema = value.get("begin"), value.get("end"), value.get("schema")
    if not isinstance(begin, str) or not isinstance(end, str):
        raise GrammarError(f"{where}.begin and .end must be strings")
    if schema is None or schema is True:
        schema = {}
    if not isinstance(schema, Mapping):
        raise GrammarError(f"{where}.schema must be a JSON schema object")
    if not any(begin.startswith(t) for t in triggers):
        raise GrammarError(
            f"{where}.begin {begin!r} starts with none of the triggers {list(triggers)}"
        )
    return Structure(begin, dict(schema), end)

"""SGLang's `structural_tag`: free text in which each trigger opens a tag (its begin, a JSON value of
its schema, its end); checked and made canonical here, and written as an llguidance Lark grammar.

The shape (SGLang's and vLLM's `response_format` and native `sampling_params.structural_tag`):
`{"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`.
Every structure's begin starts with one of the triggers. The text outside tags never contains a
trigger: once one appears, a tag whose begin starts with it must follow, then its schema's value,
then its end; after that the text is free again. The grammar may end wherever the text is free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weft.constrain.base import GrammarError

FIELDS = ("structures", "triggers")
STRUCTURE_FIELDS = ("begin", "schema", "end")
_ANY = r"(.|\n)*"  # any text, in the library's regex syntax (`.` excludes the newline)
_META = set("\\.+*?()|[]{}^$#&-~")  # punctuation the regex syntax gives a meaning to


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
        """From the request's object (or its JSON text); a GrammarError says what is wrong."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise GrammarError(f"structural_tag is not valid JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise GrammarError("structural_tag must be an object with structures and triggers")
        if "format" in value:
            raise GrammarError(
                "structural_tag with a 'format' (xgrammar's newer form) is not supported; give "
                "'structures' (each with begin, schema, end) and 'triggers'"
            )
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

    def texts(self) -> list[str]:
        """Every literal the grammar writes: triggers, begins and ends."""
        return [
            *self.triggers,
            *(s.begin for s in self.structures),
            *(s.end for s in self.structures),
        ]

    def lark(self, json_options: Mapping[str, Any]) -> str:
        """The llguidance Lark grammar; `json_options` go into every schema as its `x-guidance`.

        `TEXT` is free text without a trigger. `trigger_k` is lazy: free text up to the first
        occurrence of trigger k. A tag is a trigger, then the rest of one of its begins, the
        value and the end. (Each schema is its own `%json` rule, so `$ref`s keep their root.)
        """
        any_trigger = "|".join(_regex_literal(t) for t in self.triggers)
        lines = [
            "%llguidance {}",
            "start: tag* TEXT",
            f"TEXT: /{_ANY}/ & ~/{_ANY}({any_trigger}){_ANY}/",
            "tag: " + " | ".join(f"trigger_{k} after_{k}" for k in range(len(self.triggers))),
        ]
        for k, trigger in enumerate(self.triggers):
            lines.append(f"trigger_{k}[lazy]: TEXT {_lark_string(trigger)}")
            alternatives = []
            for j, s in enumerate(self.structures):
                if not s.begin.startswith(trigger):
                    continue
                schema = {**s.schema, "x-guidance": dict(json_options)}
                lines.append(f"value_{j}: %json {json.dumps(schema)}")
                rest = s.begin[len(trigger) :]
                parts = [_lark_string(rest) if rest else "", f"value_{j}"]
                parts.append(_lark_string(s.end) if s.end else "")
                alternatives.append(" ".join(p for p in parts if p))
            lines.append(f"after_{k}: " + " | ".join(alternatives))
        return "\n".join(lines) + "\n"


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
    for a in triggers:
        for b in triggers:
            if a != b and a in b:
                # NOTE: free text excludes every trigger, so `b` could never be written
                raise GrammarError(f"structural_tag trigger {a!r} lies inside trigger {b!r}")
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


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _regex_literal(text: str) -> str:
    """`text` matched literally in the library's regex syntax, inside Lark's /.../."""
    out = []
    for ch in text:
        if ch in _META:
            out.append("\\" + ch)
        elif ch == "/":
            out.append("\\/")
        elif ch.isalnum() or (ch.isprintable() and ch != " " and ord(ch) < 128) or ch == " ":
            out.append(ch)
        else:
            out.append(f"\\x{{{ord(ch):x}}}")
    return "".join(out)

"""Checking xgrammar's structural-tag format trees (`{"type": "structural_tag", "format": {...}}`):
shape, field types and what is supported, each problem refused by name (structural_format.py
writes the grammar of a checked tree)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from weft.constrain.errors import GrammarError

REQUIRED = object()  # a field without a default
_FIELDS: dict[str, dict[str, Any]] = {  # per type: its fields and their defaults
    "const_string": {"value": REQUIRED},
    "json_schema": {"json_schema": REQUIRED, "style": "json", "any_order": False,
                    "max_whitespace_cnt": None, "excludes": []},
    "regex": {"pattern": REQUIRED},
    "grammar": {"grammar": REQUIRED, "syntax": "ebnf"},
    "any_text": {"excludes": [], "max_tokens": None, "max_chars": None},
    "sequence": {"elements": REQUIRED},
    "or": {"elements": REQUIRED},
    "tag": {"begin": REQUIRED, "content": REQUIRED, "end": REQUIRED},
    "triggered_tags": {"triggers": REQUIRED, "tags": REQUIRED, "at_least_one": False,
                       "stop_after_first": False, "excludes": []},
    "tags_with_separator": {"tags": REQUIRED, "separator": REQUIRED, "at_least_one": False,
                            "stop_after_first": False},
    "optional": {"content": REQUIRED},
    "plus": {"content": REQUIRED},
    "star": {"content": REQUIRED},
    "repeat": {"min": REQUIRED, "max": REQUIRED, "content": REQUIRED},
}  # fmt: skip
# options accepted only at their default (what they would change is not supported)
_DEFAULT_ONLY = {
    ("json_schema", "style"),
    ("json_schema", "any_order"),
    ("json_schema", "max_whitespace_cnt"),
    ("json_schema", "excludes"),
    ("any_text", "max_tokens"),
    ("any_text", "max_chars"),
}
_TOKEN_LEVEL = ("token", "exclude_token", "any_tokens", "token_triggered_tags", "dispatch")


def check_format(node: Any, where: str = "format") -> None:
    """Raise a GrammarError naming the first problem in a format tree (shape, types, support)."""
    if not isinstance(node, Mapping) or not isinstance(node.get("type"), str):
        raise GrammarError(f"structural_tag {where} must be an object with a 'type'")
    kind = node["type"]
    if kind in _TOKEN_LEVEL:
        raise GrammarError(f"structural_tag {where}: token-level format {kind!r} is not supported")
    if kind not in _FIELDS:
        raise GrammarError(f"structural_tag {where}: unknown format type {kind!r}")
    fields = _FIELDS[kind]
    other = sorted(set(node) - set(fields) - {"type"})
    if other:
        raise GrammarError(f"structural_tag {where} ({kind}) has unknown field(s) {other}")
    for name, default in fields.items():
        if default is REQUIRED and node.get(name) is None:
            raise GrammarError(f"structural_tag {where} ({kind}) needs {name!r}")
        if (kind, name) in _DEFAULT_ONLY and node.get(name, default) != default:
            raise GrammarError(
                f"structural_tag {where} ({kind}): {name}={node[name]!r} is not supported"
            )
    _check_fields(node, kind, where)


def nested_triggers(triggers: Sequence[str], where: str) -> None:
    """Refuse a trigger inside another other than at its start: free text excludes every
    trigger, so the other could never be written. (One that starts another, "<f" and "<fun",
    is fine: the shorter opens the tags of both.)"""
    for a in triggers:
        for b in triggers:
            if a != b and a in b and not b.startswith(a):
                raise GrammarError(f"{where}: trigger {a!r} lies inside trigger {b!r}")


##### Walking a checked tree #####


def _check_fields(node: Mapping[str, Any], kind: str, where: str) -> None:
    def strings(name: str, value: Any, empty_ok: bool = True) -> None:
        items = value if isinstance(value, list) else None
        if items is None or not all(isinstance(s, str) and (s or empty_ok) for s in items):
            raise GrammarError(f"structural_tag {where}.{name} must be a list of strings")

    if kind in ("const_string", "regex", "grammar") or kind == "tags_with_separator":
        key = {"const_string": "value", "regex": "pattern", "grammar": "grammar"}.get(
            kind, "separator"
        )
        if not isinstance(node[key], str):
            raise GrammarError(f"structural_tag {where}.{key} must be a string")
    if kind == "grammar" and node.get("syntax", "ebnf") not in ("ebnf", "lark"):
        raise GrammarError(f"structural_tag {where}.syntax must be 'ebnf' or 'lark'")
    if kind == "json_schema" and not isinstance(node["json_schema"], (Mapping, bool)):
        raise GrammarError(f"structural_tag {where}.json_schema must be a JSON schema")
    if kind in ("any_text", "triggered_tags"):
        strings("excludes", node.get("excludes", []), empty_ok=False)
    if kind == "tag":
        if not isinstance(node["begin"], str):
            raise GrammarError(f"structural_tag {where}.begin must be a string (token begins are not supported)")  # fmt: skip
        end = node["end"]
        if not (isinstance(end, str) or (isinstance(end, list) and end)):
            raise GrammarError(f"structural_tag {where}.end must be a string or a list of strings")
        strings("end", end if isinstance(end, list) else [end])
    if kind == "repeat":
        lo, hi = node["min"], node["max"]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi)) or not (
            0 <= lo <= hi
        ):
            raise GrammarError(f"structural_tag {where}: repeat needs integers 0 <= min <= max")
    if kind in ("sequence", "or") and not (isinstance(node["elements"], list) and node["elements"]):
        raise GrammarError(f"structural_tag {where}.elements must be a non-empty list")
    if kind in ("triggered_tags", "tags_with_separator"):
        tags = node["tags"]
        if not isinstance(tags, list) or not tags:
            raise GrammarError(f"structural_tag {where}.tags must be a non-empty list")
        for i, tag in enumerate(tags):
            if not isinstance(tag, Mapping) or tag.get("type", "tag") != "tag":
                raise GrammarError(f"structural_tag {where}.tags[{i}] must be a tag")
    if kind == "triggered_tags":
        strings("triggers", node["triggers"], empty_ok=False)
        if not node["triggers"]:
            raise GrammarError(f"structural_tag {where}.triggers must not be empty")
        nested_triggers(node["triggers"], f"structural_tag {where}.triggers")
        for i, tag in enumerate(node["tags"]):
            begin = tag.get("begin")
            if not isinstance(begin, str) or not any(begin.startswith(t) for t in node["triggers"]):
                raise GrammarError(
                    f"structural_tag {where}.tags[{i}].begin {begin!r} starts with none of the "
                    f"triggers {node['triggers']}"
                )
    for i, child in enumerate(children(node)):
        check_format({"type": "tag", **child} if is_listed_tag(node) else child, f"{where}.{i}")


def is_listed_tag(node: Mapping[str, Any]) -> bool:
    return node["type"] in ("triggered_tags", "tags_with_separator")


def children(node: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    kind = node["type"]
    if kind in ("sequence", "or"):
        return list(node["elements"])
    if kind in ("tag", "optional", "plus", "star", "repeat"):
        return [node["content"]]
    if is_listed_tag(node):
        return [{"type": "tag", **t} for t in node["tags"]]
    return []


def tag_ends(tag: Mapping[str, Any]) -> list[str]:
    end = tag["end"]
    return [end] if isinstance(end, str) else list(end)

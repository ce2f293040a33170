"""Reasoning models' think markers (`--reasoning-parser`, SGLang's names) and their constraints:
free text up to the end of the reasoning section, then the request's grammar (JSON schema, regex,
EBNF or structural tag), as one structural tag.

The output opens with the start marker (Qwen3 writes `<think>`), or may start inside the
reasoning with the marker optional (DeepSeek-R1, whose chat template often wrote it into the
prompt), as the reasoning parser reads it; the reasoning then runs freely up to the end marker,
which the model writes as its own token where the tokenizer has one (structural_format's
structure tokens).
Up to `MAX_GAP` spaces or newlines may follow the end marker (models put a blank line there);
then the request's own constraint applies, exactly as it would without reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from weft.constrain.errors import GrammarError
from weft.constrain.spec import GrammarSpec
from weft.constrain.structural_tag import structural_tag_format

ReasoningParserName = Literal["deepseek-r1", "qwen3"]
REASONING_PARSERS: tuple[str, ...] = get_args(ReasoningParserName)


@dataclass(frozen=True)
class ReasoningFormat:
    """A model family's markers, and whether its output starts inside the reasoning."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_inside: bool = False

    def thinking(self, template_kwargs: dict[str, Any] | None) -> bool:
        """Whether a chat request's output begins with reasoning (so its constraint waits for
        the end marker): qwen3's `enable_thinking: false` turns it off, as in SGLang."""
        if self.name == "qwen3":
            return (template_kwargs or {}).get("enable_thinking", True) is not False
        return True


def reasoning_format(name: str) -> ReasoningFormat:
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}"
        )
    return ReasoningFormat(name, starts_inside=name == "deepseek-r1")


MAX_GAP = 4  # whitespace characters allowed between the end marker and the constrained answer
CONSTRAINT_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


def answer_format(kind: str, spec: str) -> dict[str, Any]:
    """The structural-tag format node of a request's constraint (`kind` one of CONSTRAINT_KEYS,
    `spec` its sampling-parameter text)."""
    if kind == "json_schema":
        schema = GrammarSpec.json_schema(spec).spec  # checked: a GrammarError says what is wrong
        return {"type": "json_schema", "json_schema": json.loads(schema)}
    if kind == "regex":
        return {"type": "regex", "pattern": spec}
    if kind == "ebnf":
        return {"type": "grammar", "grammar": spec}
    if kind == "structural_tag":
        return structural_tag_format(GrammarSpec.structural_tag(spec).spec)
    raise GrammarError(f"unknown constraint kind {kind!r}")


def after_reasoning(
    answer: Mapping[str, Any], start: str, end: str, starts_inside: bool = False
) -> str:
    """The structural tag (canonical JSON) of: the `start` marker (optional if `starts_inside`),
    free text that holds no `end`, the `end` marker, up to MAX_GAP spaces or newlines, then
    `answer` (a format node)."""
    assert start and end
    opening: dict[str, Any] = {"type": "const_string", "value": start}
    elements: list[dict[str, Any]] = [
        {"type": "optional", "content": opening} if starts_inside else opening,
        {"type": "any_text"},
        {"type": "const_string", "value": end},
        {"type": "optional", "content": {"type": "regex", "pattern": f"[ \\n]{{1,{MAX_GAP}}}"}},
        dict(answer),
    ]
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}
    return GrammarSpec.structural_tag(tag).spec


def constrain_after_reasoning(
    params: Mapping[str, Any], start: str, end: str, starts_inside: bool = False
) -> dict[str, Any]:
    """Sampling parameters whose constraint (if any) starts once the reasoning has ended: the
    json_schema / regex / ebnf / structural_tag becomes the structural_tag of `after_reasoning`
    (strict_json_schema keeps applying to the schemas inside). Without a constraint, `params`."""
    present = [k for k in CONSTRAINT_KEYS if params.get(k) is not None]
    if not present:
        return dict(params)
    if len(present) > 1:
        raise GrammarError(f"only one constraint may be given, got {', '.join(present)}")
    kind = present[0]
    out = {k: v for k, v in params.items() if k != kind}
    answer = answer_format(kind, params[kind])
    out["structural_tag"] = after_reasoning(answer, start, end, starts_inside)
    return out

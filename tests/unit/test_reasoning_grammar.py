"""A reasoning model's constraint starts after its reasoning (constrain/reasoning.py): free text,
then `</think>` (the added token), then the request's JSON schema / regex / EBNF / structural
tag, walked token by token through the llguidance matcher over a Qwen-like tokenizer."""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import pytest
from test_tool_calls import walk_ids, walk_text

from weft.constrain import GrammarError
from weft.constrain.reasoning import MAX_GAP, constrain_after_reasoning

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


@functools.cache
def qwen_like() -> Any:
    """SmolLM2's tokenizer with <think> and </think> as added tokens (special=False, as Qwen3's)."""
    from test_constrain_support import tokenizer

    tok = copy.deepcopy(tokenizer())
    tok.add_tokens(["<think>", "</think>"])
    return tok


def tag_of(starts_inside: bool = True, **params: Any) -> str:
    out = constrain_after_reasoning(params, "<think>", "</think>", starts_inside)
    assert set(out) == {"structural_tag"} | ({"strict_json_schema"} & set(params))
    return str(out["structural_tag"])


def test_free_reasoning_then_the_schema() -> None:
    tag = tag_of(json_schema=json.dumps(SCHEMA))
    tok = qwen_like()
    assert walk_text(tag, '<think>\nAnything {not json} goes.\n</think>\n\n{"a": 1}', tok) == (
        "complete"
    )
    assert walk_text(tag, 'Deepseek style</think>{"a":1}', tok) == "complete"  # no opening tag
    assert walk_text(tag, '</think>{"a": 7}', tok) == "complete"  # empty reasoning
    assert walk_text(tag, "<think>still thinking about {", tok) == "prefix"  # free, unfinished
    assert walk_text(tag, '<think>x</think>{"a": "one"}', tok) == "blocked"  # the schema holds
    assert walk_text(tag, '<think>x</think>{"a": 1, "b": 2}', tok) == "blocked"
    assert walk_text(tag, "<think>x</think>The answer", tok) == "blocked"
    assert walk_text(tag, '<think>x</think>{"a": 1} and more', tok) == "blocked"
    gap = "\n" * (MAX_GAP + 1)
    assert walk_text(tag, "<think>x</think>" + gap + '{"a": 1}', tok) == "blocked"


def test_qwen3_opens_with_the_start_marker() -> None:
    """qwen3's parser reads an output without <think> as all answer: its grammar opens with it."""
    tag = tag_of(starts_inside=False, json_schema=json.dumps(SCHEMA))
    tok = qwen_like()
    assert walk_text(tag, '<think>x</think>{"a": 1}', tok) == "complete"
    assert walk_text(tag, '</think>{"a": 1}', tok) == "blocked"
    assert walk_text(tag, 'x</think>{"a": 1}', tok) == "blocked"


def test_the_end_marker_is_the_token() -> None:
    """The model's own </think> token ends the reasoning (as SGLang's think_end_id); the marker
    spelled in ordinary tokens is refused, so the text never holds a marker the parser would
    read differently from the grammar."""
    from test_constrain_support import tokenizer

    tag = tag_of(json_schema=json.dumps(SCHEMA))
    tok = qwen_like()
    end = tok.convert_tokens_to_ids("</think>")
    plain = tokenizer().encode("</think>", add_special_tokens=False)
    assert end not in plain and len(plain) > 1
    body = tok.encode("x", add_special_tokens=False)
    answer = tok.encode('{"a":1}', add_special_tokens=False)
    assert walk_ids(tag, body + [end] + answer, tok) == "complete"
    assert walk_ids(tag, body + plain + answer, tok) == "blocked"


def test_other_constraints_after_reasoning() -> None:
    tok = qwen_like()
    regex = tag_of(regex="[0-9]{2}")
    assert walk_text(regex, "<think>hmm</think>\n42", tok) == "complete"
    assert walk_text(regex, "<think>hmm</think>4x", tok) == "blocked"
    ebnf = tag_of(ebnf='start: "yes" | "no"')
    assert walk_text(ebnf, "<think>hmm</think>no", tok) == "complete"
    assert walk_text(ebnf, "<think>hmm</think>maybe", tok) == "blocked"
    inner = {"type": "structural_tag", "format": {"type": "const_string", "value": "OK"}}
    tag = tag_of(structural_tag=json.dumps(inner), strict_json_schema=True)
    assert walk_text(tag, "<think>hmm</think>OK", tok) == "complete"


def test_params_without_a_constraint_are_kept() -> None:
    params = {"max_new_tokens": 8, "temperature": 0.0}
    assert constrain_after_reasoning(params, "<think>", "</think>") == params
    out = constrain_after_reasoning({**params, "regex": "a"}, "<think>", "</think>")
    assert out["max_new_tokens"] == 8 and "regex" not in out and "structural_tag" in out
    with pytest.raises(GrammarError, match="not valid JSON"):
        constrain_after_reasoning({"json_schema": "{"}, "<think>", "</think>")
    with pytest.raises(GrammarError, match="only one constraint"):
        constrain_after_reasoning({"json_schema": "{}", "regex": "a"}, "<think>", "</think>")

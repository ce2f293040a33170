"""structural_tag: free text where each trigger opens a tag (begin, a value of its schema, end),
checked token by token through llguidance's masks with SmolLM2's tokenizer; bad specs refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_constrain_support import STOP, VOCAB, allowed, backend, encode, tokenizer, walk

from weft.constrain import GrammarError, GrammarSpec, allocate_bitmask
from weft.runtime.sampling_params import SamplingParams

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TEXT = {"type": "any_text"}
THINK = {"type": "triggered_tags", "triggers": ["<a"], "tags": []}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = {
    "type": "structural_tag",
    "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        {"begin": "<function=add>", "schema": ADD, "end": "</function>"},
    ],
    "triggers": ["<function="],
}


def fmt(node: Any) -> dict[str, Any]:
    return {"type": "structural_tag", "format": node}


def compiled(tag: Any) -> Any:
    return backend("llguidance").compile(GrammarSpec.structural_tag(tag))


def verdict(tag: Any, text: str) -> str:
    """'complete' (may end after it), 'prefix' (valid so far, may not end) or 'blocked'."""
    w = walk(compiled(tag).matcher(), encode(text))
    if w.blocked_at is not None:
        return "blocked"
    assert not w.forced_mismatch
    return "complete" if w.stop_at_end else "prefix"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Plain text, no call at all.", "complete"),
        ("", "complete"),
        ('Checking. <function=get_weather>{"city": "Paris"}</function> Done.', "complete"),
        (
            '<function=add>{"a": 1, "b": 2}</function><function=add>{"a":3,"b":-4}</function>',
            "complete",
        ),
        ('a\n<function=get_weather>{"city": "Oslo"}</function>\nb', "complete"),
        ("We use <function", "complete"),  # not yet the whole trigger: still free text
        ("Now <function=", "prefix"),  # the trigger: a tag must follow
        ('<function=get_weather>{"city": "Paris"}', "prefix"),  # the end must follow
        ("<function=mul>{}</function>", "blocked"),  # no structure begins like that
        ('<function=add>{"a": "x", "b": 2}</function>', "blocked"),  # against the schema
        ('<function=add>{"a": 1, "b": 2, "c": 3}</function>', "blocked"),
        ('<function=add>{"a": 1, "b": 2}</function=add>', "blocked"),  # the end is forced
    ],
)
def test_text_tags_and_schemas_token_by_token(text: str, expected: str) -> None:
    assert verdict(TOOLS, text) == expected


def test_the_spec_is_canonical_json_whether_given_as_text_or_object() -> None:
    a = GrammarSpec.structural_tag(TOOLS)
    b = GrammarSpec.structural_tag(json.dumps({k: v for k, v in TOOLS.items() if k != "type"}))
    assert a == b and a.kind == "structural_tag"
    body = json.loads(a.spec)
    assert body["triggers"] == ["<function="] and body["structures"][1]["schema"] == ADD


def test_several_triggers_shared_begins_refs_and_a_missing_schema() -> None:
    tag = {
        "structures": [
            {"begin": "[[", "schema": {"type": "integer", "maximum": 9}, "end": "]]"},
            # the same begin and end twice: either schema's value
            {"begin": "<t>", "schema": {"type": "boolean"}, "end": "</t>"},
            {
                "begin": "<t>",
                "schema": {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s"},
                "end": "</t>",
            },
            {"begin": "@any ", "end": "\n"},  # no schema: any JSON value
        ],
        "triggers": ["[[", "<t>", "@any"],
    }
    assert verdict(tag, 'x [[7]] y <t>true</t> z <t>"s"</t>') == "complete"
    assert verdict(tag, '@any {"k": [1, null]}\nrest') == "complete"
    assert verdict(tag, "[[12]]") == "blocked"  # maximum
    assert verdict(tag, "<t>3</t>") == "blocked"
    assert verdict(tag, "x [ [ y") == "complete"


def test_triggers_with_regex_syntax_slashes_newlines_and_unicode() -> None:
    for trigger in ["/*tool*/", "(a|b)[x]{1}.+?$^\\", "\n>>>", "→call"]:
        tag = {
            "structures": [{"begin": trigger + "(", "schema": ADD, "end": ")"}],
            "triggers": [trigger],
        }
        call = trigger + '({"a": 1, "b": 2})'
        assert verdict(tag, "before " + call + " after") == "complete", trigger
        assert verdict(tag, "before " + trigger + "x") == "blocked", trigger
        # the trigger's characters alone are free text
        assert verdict(tag, "before " + trigger[:-1] + " after") == "complete", trigger


def test_only_free_text_may_end_and_json_whitespace_stays_bounded() -> None:
    text = 'Hi <function=add>{"a": 1, "b": 2}</function> ok'
    ids = encode(text)
    w = walk(compiled(TOOLS).matcher(), ids)
    prefixes = [tokenizer().decode(ids[:k]) for k in range(len(ids) + 1)]
    # after k tokens: inside the tag from the whole trigger until the whole end
    inside = [k for k, p in enumerate(prefixes) if "<function=" in p and "</function>" not in p]
    assert inside and w.stop_at_end
    assert set(w.early_stops) == set(range(len(ids))) - set(inside)
    assert verdict(TOOLS, "<function=add>{" + " " * 40 + '"a": 1, "b": 2}</function>') == "blocked"


def test_a_trigger_that_starts_another_opens_the_tags_of_both() -> None:
    tag = {
        "structures": [
            {"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"},
            {"begin": "<fun>", "schema": {"type": "string"}, "end": "</fun>"},
        ],
        "triggers": ["<f", "<fun"],
    }
    assert verdict(tag, 'a <f>1</f> b <fun>"x"</fun> c') == "complete"
    assert verdict(tag, "<fun>1</fun>") == "blocked"
    assert verdict(tag, "<fx") == "blocked"


def test_keywords_a_schema_does_not_enforce_are_reported() -> None:
    tag = {
        "structures": [
            {"begin": "<l>", "schema": {"type": "array", "uniqueItems": True}, "end": "</l>"}
        ],
        "triggers": ["<l>"],
    }
    assert compiled(tag).unenforced == ("uniqueItems",)
    with pytest.raises(GrammarError, match="uniqueItems"):
        backend("llguidance", strict=True).compile(GrammarSpec.structural_tag(tag))
    with pytest.raises(GrammarError, match="uniqueItems.*strict is true"):  # the request's own
        backend("llguidance").compile(GrammarSpec.structural_tag(tag, strict=True))


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("{not json", "not valid JSON"),
        ([1], "must be an object"),
        ({"triggers": ["<f"]}, "structures must be a non-empty list"),
        ({"structures": [], "triggers": ["<f"]}, "structures must be a non-empty list"),
        ({"structures": [{"begin": "<f>", "end": ""}]}, "triggers must be a non-empty list"),
        ({"structures": [{"begin": "<f>", "end": ""}], "triggers": [""]}, "non-empty strings"),
        ({"structures": [{"begin": "<f>", "end": ""}], "triggers": ["<g"]}, "starts with none"),
        ({"structures": [{"begin": "<f>", "end": ""}], "triggers": ["<f", "<g"]}, "'<g' begins no"),
        ({"structures": [{"begin": "<f>", "end": 3}], "triggers": ["<f"]}, "must be strings"),
        (
            {"structures": [{"begin": "<f>", "end": "", "schema": [1]}], "triggers": ["<f"]},
            "schema",
        ),
        (
            {"structures": [{"begin": "<f>", "end": "", "x": 1}], "triggers": ["<f"]},
            "unknown field",
        ),
        ({"structures": [{"begin": "<f>", "end": ""}], "triggers": ["<f"], "extra": 1}, "unknown"),
        ({"structures": [{"begin": "<f>", "end": ""}], "triggers": ["<f", "f"]}, "lies inside"),
        (
            {
                "format": {
                    "type": "triggered_tags",
                    "triggers": ["f=", "<f="],
                    "tags": [{"begin": "<f=", "content": TEXT, "end": ">"}],
                }
            },
            "'f=' lies inside trigger '<f='",
        ),  # fmt: skip
        ({"type": "json_schema", "structures": [], "triggers": []}, "type must be"),
        ({"format": {"type": "token", "token": 5}}, "token-level format 'token'"),
        ({"format": {"type": "nope"}}, "unknown format type 'nope'"),
        ({"format": {"type": "const_string"}}, "needs 'value'"),
        ({"format": {"type": "json_schema", "json_schema": ADD, "style": "qwen_xml"}}, "style"),
        ({"format": {"type": "any_text", "max_tokens": 5}}, "max_tokens=5 is not supported"),
        ({"format": {"type": "repeat", "min": 3, "max": 1, "content": TEXT}}, "0 <= min <= max"),
        ({"format": {"type": "sequence", "elements": []}}, "non-empty list"),
        ({"format": {"type": "tag", "begin": "<a>", "content": TEXT, "end": []}}, "end must be"),
        ({"format": {"type": "or", "elements": [TEXT], "x": 1}}, "unknown field"),
        ({"format": {**THINK, "tags": [{"begin": "<b>", "content": TEXT, "end": "</b>"}]}}, "none"),
        ({"type": "text", "format": TEXT}, "type must be"),
    ],
)
def test_bad_specs_are_refused_with_the_reason(tag: Any, message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        GrammarSpec.structural_tag(tag)


FILENAME, FILE_SEP = 6, 5  # SmolLM2's added (special) tokens <filename> and <file_sep>
FILE_TAG = {
    "structures": [{"begin": "<filename>", "schema": WEATHER, "end": "<file_sep>"}],
    "triggers": ["<filename>"],
}


def test_special_tokens_in_tags_are_the_tokens_themselves() -> None:
    """A tag text holding a special / added token's text (as Qwen's <tool_call> is) means that
    token: the model writes it as the one token, never spelled out in ordinary tokens, and no
    other special token is allowed."""
    tag = FILE_TAG
    text_ids = encode("Let me look. ")
    value_ids = encode('{"city": "Oslo"}')
    assert FILENAME not in text_ids and encode("<filename>") == [FILENAME]
    done = encode(" Done.")
    m = compiled(tag).matcher()
    w = walk(m, [*text_ids, FILENAME, *value_ids, FILE_SEP, *done])
    assert w.accepted and not w.forced_mismatch
    after = len(text_ids) + len(value_ids) + 2  # the free text again, after <file_sep>
    assert w.early_stops == [*range(len(text_ids) + 1), *range(after, after + len(done))]
    # the value must follow the token; other special tokens are never allowed
    m = compiled(tag).matcher()
    bitmask = allocate_bitmask(1, VOCAB)
    m.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, FILENAME) and not allowed(bitmask, FILE_SEP)
    assert not allowed(bitmask, 1) and allowed(bitmask, STOP)
    assert m.accept_token(FILENAME) and not m.accept_token(FILE_SEP)
    # spelled out in ordinary tokens, the trigger's text is not free text
    spelled = [i for piece in ("<", "filename", ">") for i in encode(piece)]
    assert walk(compiled(tag).matcher(), spelled).blocked_at is not None
    # jump-forward: a token inside a literal is forced like text
    name = fmt({"type": "sequence", "elements": [
        {"type": "const_string", "value": "Name:<filename>"}, {"type": "any_text"},
    ]})  # fmt: skip
    assert compiled(name).matcher().forced_tokens() == [*encode("Name:"), FILENAME]


def test_structure_tokens_in_the_newer_form_and_what_is_refused() -> None:
    tag = fmt({"type": "sequence", "elements": [
        {"type": "const_string", "value": "<filename>"},
        {"type": "any_text"},
        {"type": "const_string", "value": "<file_sep>"},
    ]})  # fmt: skip
    assert verdict(tag, "<filename>notes.txt<file_sep>") == "complete"
    assert verdict(tag, "<filename>notes<file_sep>more") == "blocked"
    stop = {"structures": [{"begin": "<|im_end|>call", "end": ""}], "triggers": ["<|im_end|>"]}
    with pytest.raises(GrammarError, match="a stop token of the model"):
        compiled(stop)
    inside = {
        "structures": [{"begin": "call<filename>", "end": ""}],
        "triggers": ["call<filename>"],
    }
    with pytest.raises(GrammarError, match="a special token may only start a trigger"):
        compiled(inside)


def test_the_outlines_backend_refuses_structural_tags() -> None:
    with pytest.raises(GrammarError, match="outlines backend does not support structural_tag"):
        backend("outlines").compile(GrammarSpec.structural_tag(TOOLS))


def test_sampling_params_take_it_as_text_or_object_and_alone() -> None:
    p = SamplingParams.from_dict({"structural_tag": TOOLS})
    assert p.structural_tag is not None and json.loads(p.structural_tag) == TOOLS
    with pytest.raises(ValueError, match="cannot be combined"):
        SamplingParams.from_dict({"structural_tag": TOOLS, "regex": "a"})
    with pytest.raises(ValueError, match="valid JSON"):
        SamplingParams.from_dict({"structural_tag": "{"})

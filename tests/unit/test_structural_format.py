"""xgrammar's newer structural tag (`{"format": ...}`), checked token by token as in
test_structural_tag.py; random specs compile or are refused with a reason, never crash."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_constrain_support import backend
from test_structural_tag import ADD, TEXT, TOOLS, WEATHER, compiled, fmt, verdict

from weft.constrain import GrammarError, GrammarSpec

##### xgrammar's newer form: {"format": ...} #####


def call(name: str, schema: Any) -> dict[str, Any]:
    return {
        "begin": f"<function={name}>",
        "content": {"type": "json_schema", "json_schema": schema},
        "end": "</function>",
    }


TAGS = [call("get_weather", WEATHER), call("add", ADD)]


def test_the_older_form_is_the_newer_forms_triggered_tags() -> None:
    newer = fmt({"type": "triggered_tags", "triggers": ["<function="], "tags": TAGS})
    for text in [
        'Checking. <function=get_weather>{"city": "Paris"}</function> Done.',
        "<function=mul>{}</function>",
        '<function=add>{"a": 1, "b": 2}</function=add>',
        "Now <function=",
    ]:
        assert verdict(newer, text) == verdict(TOOLS, text), text


def test_triggered_tags_at_least_one_stop_after_first_and_excludes() -> None:
    base = {"type": "triggered_tags", "triggers": ["<function="], "tags": TAGS}
    one = '<function=add>{"a": 1, "b": 2}</function>'
    assert verdict(fmt({**base, "at_least_one": True}), "no call") == "prefix"
    assert verdict(fmt({**base, "at_least_one": True}), "x " + one + one + " y") == "complete"
    first = fmt({**base, "stop_after_first": True})
    assert verdict(first, "no call") == "complete"
    assert verdict(first, "x " + one) == "complete"
    assert verdict(first, "x " + one + " more") == "blocked"  # nothing after the first tag
    only = fmt({**base, "stop_after_first": True, "at_least_one": True})
    assert verdict(only, one) == "complete" and verdict(only, "text") == "prefix"
    assert verdict(fmt({**base, "excludes": ["BAD"]}), "a BAD word") == "blocked"


def test_a_think_tag_then_a_json_answer() -> None:
    think = {"type": "tag", "begin": "<think>", "content": TEXT, "end": ["</think>", "</t>"]}
    answer = {"type": "json_schema", "json_schema": ADD}
    tag = fmt(
        {"type": "sequence", "elements": [think, {"type": "const_string", "value": "\n"}, answer]}
    )
    assert verdict(tag, '<think>a < b, {x}</think>\n{"a": 1, "b": 2}') == "complete"
    assert verdict(tag, '<think>short</t>\n{"a": 1, "b": 2}') == "complete"
    assert verdict(tag, "<think>still thinking") == "prefix"
    assert verdict(tag, '<think>done</think>\n{"a": "x"}') == "blocked"
    assert verdict(tag, "<answer>") == "blocked"
    # any_text then a string, in a sequence: text up to the first occurrence of the string
    upto = fmt({"type": "sequence", "elements": [TEXT, {"type": "const_string", "value": "END"}]})
    assert verdict(upto, "anything at all END") == "complete"
    assert verdict(upto, "a END b") == "blocked"


def test_tags_with_separator() -> None:
    sep = {"type": "tags_with_separator", "tags": TAGS, "separator": ","}
    one = '<function=add>{"a": 1, "b": 2}</function>'
    weather = '<function=get_weather>{"city": "Rome"}</function>'
    assert verdict(fmt(sep), "") == "complete"
    assert verdict(fmt(sep), one + "," + weather) == "complete"
    assert verdict(fmt(sep), one + " " + weather) == "blocked"  # only the separator between
    assert verdict(fmt({**sep, "at_least_one": True}), "") == "prefix"
    assert verdict(fmt({**sep, "stop_after_first": True}), one + ",") == "blocked"


def test_or_regex_grammar_const_and_repetition() -> None:
    word = {"type": "regex", "pattern": "[a-z]+/[0-9]{2}"}
    number = {"type": "grammar", "grammar": 'root ::= "n=" [0-9]+'}
    either = {"type": "or", "elements": [word, number, {"type": "const_string", "value": "none"}]}
    comma = {"type": "const_string", "value": ","}
    item = {"type": "sequence", "elements": [either, comma]}
    tag = fmt({"type": "repeat", "min": 1, "max": 3, "content": item})
    assert verdict(tag, "ab/12,n=7,none,") == "complete"
    assert verdict(tag, "ab/12,") == "complete"
    assert verdict(tag, "a,b,c,d,") == "blocked"
    assert verdict(tag, "ab/1x,") == "blocked"
    assert verdict(tag, "") == "prefix"
    star = fmt(
        {
            "type": "sequence",
            "elements": [{"type": "star", "content": comma}, {"type": "optional", "content": word}],
        }
    )
    assert verdict(star, ",,,") == "complete" and verdict(star, ",,x/00") == "complete"
    assert verdict(fmt({"type": "plus", "content": comma}), "") == "prefix"


def test_any_text_must_end_the_text_or_come_before_a_string() -> None:
    bad = fmt({"type": "sequence", "elements": [TEXT, {"type": "json_schema", "json_schema": ADD}]})
    with pytest.raises(GrammarError, match="any_text must end the text"):
        compiled(bad)
    assert verdict(fmt(TEXT), "anything\n at all") == "complete"
    excluded = fmt({"type": "any_text", "excludes": ["<|", "DROP"]})
    assert verdict(excluded, "fine text") == "complete"
    assert verdict(excluded, "please DROP it") == "blocked"


##### Random specs: a compiled grammar or a GrammarError, never another exception #####

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2, 5), st.text(max_size=3))
_LEAVES = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("const_string"),
            "value": st.one_of(st.text(max_size=3), st.sampled_from(["<filename>", "a<file_sep>"])),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("any_text")}, optional={"excludes": st.lists(st.text(max_size=2))}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.sampled_from([{"type": "integer"}, {}, True, False, 3, {"type": 1}]),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("regex"), "pattern": st.sampled_from(["[a-c]+", "(", "a/b", "\\/"])}
    ),
    st.fixed_dictionaries(
        {"type": st.just("grammar"), "grammar": st.sampled_from(['root ::= "y"', "root ::="])}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["token", "nope", "dispatch"])}),
    _SCALARS,
)
_ENDS = st.one_of(
    st.sampled_from(["</a>", "", ")", "<file_sep>", "<|im_end|>"]),
    st.lists(st.sampled_from(["x", "", "<file_sep>"]), max_size=2),
)


def _nodes(inner: Any) -> Any:
    tag = st.fixed_dictionaries(
        {
            "begin": st.sampled_from(["<a>", "@x", "", 3, "<filename>", "<filename>x"]),
            "content": inner,
            "end": _ENDS,
        }
    )
    return st.one_of(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["sequence", "or"]), "elements": st.lists(inner, max_size=3)}
        ),
        tag.map(lambda t: {"type": "tag", **t}),
        st.fixed_dictionaries(
            {
                "type": st.just("triggered_tags"),
                "triggers": st.lists(
                    st.sampled_from(["<a", "@", "", "<a>", "<filename>", "x<filename>"]), max_size=2
                ),
                "tags": st.lists(tag, max_size=2),
            },
            optional={"at_least_one": st.booleans(), "stop_after_first": _SCALARS},
        ),
        st.fixed_dictionaries(
            {"type": st.just("tags_with_separator"), "tags": st.lists(tag, max_size=2)},
            optional={"separator": _SCALARS, "at_least_one": st.booleans()},
        ),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["optional", "plus", "star"]), "content": inner}
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("repeat"),
                "min": st.sampled_from([0, 1, 3, -1, 10**9]),
                "max": st.sampled_from([0, 2, 10**9, "2"]),
                "content": inner,
            }
        ),
    )


FORMATS = st.recursive(_LEAVES, _nodes, max_leaves=5)
OLDER = st.fixed_dictionaries(
    {
        "structures": st.lists(
            st.fixed_dictionaries(
                {
                    "begin": st.sampled_from(["@a(", "<f>", "", "<filename>{"]),
                    "schema": st.sampled_from([{"type": "integer"}, None, 3]),
                    "end": st.sampled_from([")", ""]),
                }
            ),
            max_size=2,
        ),
        "triggers": st.lists(st.sampled_from(["@", "<f", "", "@a", "<filename>"]), max_size=2),
    }
)
STRUCTURAL = st.one_of(OLDER, st.fixed_dictionaries({"format": FORMATS}), _SCALARS)


@settings(max_examples=150, deadline=None)
@given(STRUCTURAL)
def test_random_specs_compile_or_are_refused_with_a_reason(tag: Any) -> None:
    try:
        spec = GrammarSpec.structural_tag(tag)
        backend("llguidance").compile(spec)
    except GrammarError as e:
        assert str(e)

"""The request-body boundary: JSON parsed without RecursionError, nesting bounded, lone surrogates
refused with the path they sit at, and requests the IPC codec refuses turned into a ValueError."""

from __future__ import annotations

import json

import pytest

from weft.runtime.ipc.messages import TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.server.http.body import MAX_JSON_DEPTH, check_json_value, parse_json_body
from weft.runtime.server.request_parts import encode_parts
from weft.runtime.text_checks import check_text, lone_surrogate


def test_nesting_is_bounded_without_recursion() -> None:
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json_body(at_limit.encode()) is not None
    with pytest.raises(ValueError, match=f"deeper than {MAX_JSON_DEPTH} levels"):
        parse_json_body(("[" + at_limit + "]").encode())
    with pytest.raises(ValueError, match="deeper than"):  # the C parser's RecursionError
        parse_json_body(b"[" * 100_000 + b"]" * 100_000)
    deep: list[object] = []
    for _ in range(5000):  # built in Python: the walk itself never recurses
        deep = [deep]
    with pytest.raises(ValueError, match=r"deeper than .* \(at y\[0\]\[0\]"):
        check_json_value({"x": 1, "y": deep})


def test_lone_surrogates_are_refused_where_they_are() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "ok \ud800"}]}).encode()
    with pytest.raises(ValueError, match=r"messages\[0\]\.content contains a lone UTF-16"):
        parse_json_body(body)
    with pytest.raises(ValueError, match=r"a key"):
        parse_json_body(json.dumps({"\udc00": 1}).encode())
    pair = json.dumps({"text": "\U0001f600"})  # written as the escape pair \ud83d\ude00
    assert "\\ud83d\\ude00" in pair and parse_json_body(pair.encode()) == {"text": "\U0001f600"}
    assert lone_surrogate("caf\u00e9") is None and lone_surrogate("ab\udfff") == 2
    with pytest.raises(ValueError, match="stop contains"):
        check_text("\ud800x", "stop")
    with pytest.raises(ValueError, match="stop contains"):
        SamplingParams.from_dict({"stop": ["a", "\ud800"]})


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"", "malformed JSON"),
        (b'{"a": "\xff"}', "not valid UTF-8"),
        (b'{"a": "\xed\xa0\x80"}', "not valid UTF-8"),  # a surrogate encoded as UTF-8 bytes
        (b'{"a": 1' + b"0" * 5000 + b"}", "number too long"),
    ],
)
def test_bodies_that_are_not_json_text(raw: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_json_body(raw)


def test_utf8_bom_and_utf16_bodies_still_parse() -> None:
    assert parse_json_body(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}
    assert parse_json_body('{"a": "\u00e9"}'.encode("utf-16")) == {"a": "\u00e9"}


def test_integers_beyond_the_codec_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="top_k is too large"):
        SamplingParams.from_dict({"top_k": 10**30})
    with pytest.raises(ValueError, match="min_new_tokens is too large"):
        SamplingParams.from_dict({"max_new_tokens": None, "min_new_tokens": 10**30})


@pytest.mark.parametrize(
    "fields", [{"top_logprobs_num": 10**30}, {"rid": "\ud800"}, {"input_ids": [-(2**70)]}]
)
def test_a_request_the_codec_refuses_is_a_value_error(fields: dict[str, object]) -> None:
    """Encoded before anything is registered or sent: no rid is left held (tokenizer_manager)."""
    req = TokenizedGenerateReq(
        **{"rid": "r", "input_ids": [1], "params": SamplingParams(), "max_new_tokens": 1, **fields}
    )
    with pytest.raises(ValueError, match="cannot be sent to the scheduler"):
        encode_parts([req])
    ok = TokenizedGenerateReq(rid="s", input_ids=[1], params=SamplingParams(), max_new_tokens=1)
    assert len(encode_parts([ok])) == 1

"""Random regexes, EBNF grammars and JSON schemas against a live `weft serve` (tiny model): every
reply is a 200 or a 4xx with a message, never a 5xx, and after each the server is healthy and a
plain request still works. The known killers (`a{1000000}`, deep schemas, huge enums, ...) are
explicit examples; `\\d` output is ASCII digits only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support import ServerProcess


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("grammar-fuzz") / "serve.log"
    proc = ServerProcess(["--model", str(tiny_model_dir), "--grammar-timeout", "5"], log)
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() == 0, log.read_text()[-3000:]


def deep_schema(levels: int) -> str:
    return '{"type":"array","items":' * levels + '{"type":"integer"}' + "}" * levels


KILLER_REGEXES = [
    "a{1000000}",
    "(a{1000}){1000}",
    "a{1000000,}",
    "(?=a)b",
    "(?<=a)b",
    "(a)\\1",
    "(",
    "[",
    "a{2,1}",
    "\\",
    "(" * 5000 + "a" + ")" * 5000,
    "x" * 200_000,
]
KILLER_EBNF = [
    'root ::= "a"{1000000}',
    'start: "a"~1000000',
    'start: ("a"~9000)~9',  # within the limits: fails in the library mid-generation
    "start: /a{1000000}/",
    "root ::= ",
    "start: start",
    "start: " + "(" * 3000 + '"a"' + ")" * 3000,
    'root ::= [^"]* "x"',
]
KILLER_SCHEMAS = [
    deep_schema(200),
    deep_schema(5000),
    json.dumps({"enum": [f"v{i}" for i in range(60_000)]}),
    json.dumps({"type": "string", "pattern": "a{1000000}"}),
    json.dumps({"type": "string", "pattern": "(?=x)y"}),
    json.dumps({"type": "string", "minLength": 10**9}),
    json.dumps({"type": "integer", "minimum": -1e300, "maximum": 1e300}),
    json.dumps({"type": "object", "x-unknown-keyword": {"nested": [1, 2]}, "frobnicate": True}),
    json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    json.dumps({"allOf": [{"$ref": "#"}]}),
    json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}}}),
    json.dumps({"$ref": "https://example.com/schema.json"}),
    json.dumps({"type": "array", "minItems": 100_000, "items": {"type": "integer"}}),
    "[" * 100_000,
]

REGEX_ATOMS = st.sampled_from(
    ["a", "b", ".", "\\d", "\\w", "\\s", "[a-c]", "[^x]", "\\D", "(", ")", "|", "[", "]", "\\"]
)
QUANTIFIERS = st.one_of(
    st.sampled_from(["", "", "*", "+", "?", "{2}", "{0,3}", "{1,}", "*?"]),
    st.integers(0, 2_000_000).map(lambda n: f"{{{n}}}"),
)
REGEXES = st.lists(st.tuples(REGEX_ATOMS, QUANTIFIERS), max_size=8).map(
    lambda parts: "".join(a + q for a, q in parts)
)
EBNF_ITEMS = st.one_of(
    st.sampled_from(['"a"', '"yes"', "/[0-9]+/", "/\\d{2}/", "x", "(", ")", "|", "*", "+", "?"]),
    st.integers(0, 2_000_000).map(lambda n: f'"a"~{n}'),
)
EBNF = st.one_of(
    st.lists(EBNF_ITEMS, max_size=6).map(lambda xs: "start: " + " ".join(xs) + "\nx: /[a-z]+/"),
    st.lists(EBNF_ITEMS, max_size=6).map(lambda xs: "root ::= " + " ".join(xs).replace("~", "")),
)
SCHEMA_LEAVES = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean"])}),
    st.fixed_dictionaries(
        {"type": st.just("string")},
        optional={
            "pattern": REGEXES,
            "minLength": st.integers(-1, 10**9),
            "maxLength": st.integers(-1, 10**9),
            "format": st.sampled_from(["date", "email", "uuid", "nonsense"]),
        },
    ),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(st.text(max_size=4), st.integers()))}),
    st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/$defs/x", "other.json"])}),
    st.dictionaries(st.sampled_from(["type", "const", "not", "x-bogus", "items"]), st.integers()),
)
SCHEMAS = st.recursive(
    SCHEMA_LEAVES,
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=3), inner)},
            optional={"required": st.lists(st.text(max_size=3)), "additionalProperties": inner},
        ),
        st.fixed_dictionaries(
            {"type": st.just("array"), "items": inner},
            optional={"minItems": st.integers(-1, 10**6), "maxItems": st.integers(0, 10**6)},
        ),
        st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}),
        st.fixed_dictionaries({"allOf": st.lists(inner, max_size=2)}),
    ),
    max_leaves=6,
).map(json.dumps)
FUZZ = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    database=None,
)


def generate(server: Any, params: dict[str, Any], stream: bool = False) -> httpx.Response:
    body = {"text": "Hi", "stream": stream, "sampling_params": {"max_new_tokens": 3, **params}}
    return httpx.post(f"{server.url}/generate", json=body, timeout=60)


def check_answer_and_health(server: Any, resp: httpx.Response) -> None:
    assert resp.status_code == 200 or 400 <= resp.status_code < 500, (
        resp.status_code,
        resp.text[:500],
    )
    if resp.status_code != 200:
        assert resp.json()["error"]["message"], resp.text[:500]
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    plain = generate(server, {"max_new_tokens": 2})
    assert plain.status_code == 200, plain.text[:500]


@FUZZ
@given(pattern=REGEXES, stream=st.booleans())
def test_random_regexes(tiny_server: Any, pattern: str, stream: bool) -> None:
    check_answer_and_health(tiny_server, generate(tiny_server, {"regex": pattern}, stream))


@pytest.mark.parametrize("pattern", KILLER_REGEXES, ids=lambda p: p[:20])
def test_killer_regexes(tiny_server: Any, pattern: str) -> None:
    resp = generate(tiny_server, {"regex": pattern})
    check_answer_and_health(tiny_server, resp)
    if "{1000000" in pattern:
        assert resp.status_code == 400 and "grammar limit max_repeat" in resp.text


@FUZZ
@given(grammar=EBNF)
@example(grammar=KILLER_EBNF[0])
def test_random_ebnf(tiny_server: Any, grammar: str) -> None:
    check_answer_and_health(tiny_server, generate(tiny_server, {"ebnf": grammar}))


@pytest.mark.parametrize("grammar", KILLER_EBNF, ids=lambda g: g[:24])
@pytest.mark.parametrize("stream", [False, True])
def test_killer_ebnf(tiny_server: Any, grammar: str, stream: bool) -> None:
    resp = generate(tiny_server, {"ebnf": grammar}, stream)
    check_answer_and_health(tiny_server, resp)
    if "1000000" in grammar:
        assert resp.status_code == 400 and "grammar limit max_repeat" in resp.text


@FUZZ
@given(schema=SCHEMAS)
def test_random_json_schemas(tiny_server: Any, schema: str) -> None:
    check_answer_and_health(tiny_server, generate(tiny_server, {"json_schema": schema}))


@pytest.mark.parametrize("schema", KILLER_SCHEMAS, ids=lambda s: s[:24])
def test_killer_json_schemas(tiny_server: Any, schema: str) -> None:
    check_answer_and_health(tiny_server, generate(tiny_server, {"json_schema": schema}))


def test_deeply_nested_schema_as_an_object_and_a_huge_structural_repeat(tiny_server: Any) -> None:
    check_answer_and_health(
        tiny_server, generate(tiny_server, {"json_schema": json.loads(deep_schema(300))})
    )
    repeat = {
        "format": {
            "type": "repeat",
            "min": 0,
            "max": 10**9,
            "content": {"type": "regex", "pattern": "a"},
        }
    }
    resp = generate(tiny_server, {"structural_tag": json.dumps(repeat)})
    check_answer_and_health(tiny_server, resp)
    assert resp.status_code == 400 and "grammar limit max_repeat" in resp.text


def test_d_emits_ascii_digits_only(tiny_server: Any) -> None:
    for seed in range(4):
        params = {"regex": "\\d+", "max_new_tokens": 12, "temperature": 1.0, "sampling_seed": seed}
        resp = generate(tiny_server, params)
        assert resp.status_code == 200, resp.text
        text = resp.json()["text"]
        assert text and set(text) <= set("0123456789"), repr(text)


def test_a_body_nested_too_deeply_to_read_is_a_400(tiny_server: Any) -> None:
    schema = '{"items":' * 100_000 + "{}" + "}" * 100_000
    body = '{"text": "Hi", "sampling_params": {"max_new_tokens": 2, "json_schema": ' + schema + "}}"
    resp = httpx.post(
        f"{tiny_server.url}/generate",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert resp.status_code == 400 and "deeper than 128 levels" in resp.text, resp.text[:300]
    check_answer_and_health(tiny_server, resp)


def test_a_grammar_failing_mid_stream_ends_that_stream_with_an_error_event(
    tiny_server: Any,
) -> None:
    # within the limits; the library runs out of items once the "!" is accepted, which comes
    # after at least two sampled tokens (one per step): the first event is out by then
    grammar = 'start: /[a-z]{1,2}/ " " /[a-z]{1,2}/ "!" ("a"~9000)~9'
    params = {"max_new_tokens": 20, "ebnf": grammar, "temperature": 0.0}
    body = {"text": "Hi", "stream": True, "sampling_params": params}
    with httpx.stream("POST", f"{tiny_server.url}/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "output_ids" in json.loads(events[0]), events
    error = json.loads(events[-2])["error"]
    assert error["code"] == 400 and "grammar error" in error["message"], error
    check_answer_and_health(tiny_server, generate(tiny_server, {"regex": "[ab]{2}"}))

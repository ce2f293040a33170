"""Random bodies against a real `weft serve`: every reply is a 200 or a 4xx with a message (never a
5xx, a hang or a dead scheduler), and the server is healthy and idle afterwards."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SMALL_INTS = st.one_of(st.integers(-3, 6), st.sampled_from([2**31, 10**12, -(2**40)]))
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    SMALL_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.dictionaries(st.text(max_size=4), SCALARS, max_size=2),
)
TOKEN = st.integers(0, 49151)
FRACTION = st.floats(0.0, 1.0)
# each parameter: a plausible value (often valid, so requests reach the scheduler) or anything
PLAUSIBLE: dict[str, Any] = {
    "max_new_tokens": st.integers(0, 4),
    "min_new_tokens": st.integers(0, 3),
    "stop": st.lists(st.text(max_size=3), max_size=2),
    "stop_token_ids": st.lists(TOKEN, max_size=2),
    "stop_regex": st.lists(st.sampled_from([r"\d", "a+b", "[.!?]", "(", ""]), max_size=2),
    "temperature": st.floats(0.0, 2.0),
    "top_p": FRACTION,
    "top_k": st.integers(-2, 50),
    "min_p": FRACTION,
    "frequency_penalty": st.floats(-2.5, 2.5),
    "presence_penalty": st.floats(-2.5, 2.5),
    "repetition_penalty": st.floats(0.0, 2.5),
    "n": st.integers(0, 3),
    "json_schema": st.sampled_from(
        ['{"type": "object"}', '{"type": "string", "maxLength": 3}', '{"type": "integer"}', "{"]
    ),
    "regex": st.sampled_from(["[ab]{1,3}", r"\d+", "("]),
    "ebnf": st.sampled_from(['root ::= "yes" | "no"', "root ::= "]),
    "structural_tag": st.sampled_from(
        [
            {
                "structures": [{"begin": "@a(", "schema": {"type": "integer"}, "end": ")"}],
                "triggers": ["@"],
            },
            {"structures": [{"begin": "@a(", "end": ")"}], "triggers": ["#"]},
            {
                "format": {
                    "type": "sequence",
                    "elements": [{"type": "any_text"}, {"type": "const_string", "value": "."}],
                }
            },
            {
                "format": {
                    "type": "repeat",
                    "min": 0,
                    "max": 10**9,
                    "content": {"type": "regex", "pattern": "a"},
                }
            },
            {"format": {"type": "token", "token": 1}},
            '{"format": ',
        ]
    ),
    "strict_json_schema": st.booleans(),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "logit_bias": st.dictionaries(TOKEN.map(str), st.floats(-100, 100), max_size=2),
    "sampling_seed": st.integers(-1, 2**32),
    "not_a_parameter": st.just(1),
}
SAMPLING = st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=5, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries(
        {k: st.one_of(PLAUSIBLE[k], PLAUSIBLE[k], VALUES) for k in keys}
    )
)
PROMPTS = st.one_of(
    st.sampled_from(["Hi", "The capital of France is", "1, 2, 3,"]),
    st.text(max_size=12),
    st.lists(st.text(max_size=6), max_size=3),
    SCALARS,
    st.lists(SMALL_INTS, max_size=3),
)
OPTIONAL = {
    "stream": st.one_of(st.booleans(), VALUES),
    "return_logprob": st.one_of(st.booleans(), VALUES),
    "logprob_start_len": st.one_of(st.integers(-1, 3), VALUES),
    "top_logprobs_num": st.one_of(st.integers(0, 3), VALUES),
    "rid": VALUES,
}
NATIVE = st.one_of(
    st.fixed_dictionaries({"text": PROMPTS, "sampling_params": SAMPLING}, optional=OPTIONAL),
    st.fixed_dictionaries(
        {
            "input_ids": st.one_of(st.lists(TOKEN, min_size=1, max_size=4), VALUES),
            "sampling_params": SAMPLING,
        },
        optional=OPTIONAL,
    ),
    st.fixed_dictionaries(
        {"sampling_params": st.one_of(SAMPLING, VALUES)},
        optional={**OPTIONAL, "text": PROMPTS, "input_ids": VALUES},
    ),
)
MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"])},
            optional={"content": st.one_of(st.text(max_size=8), VALUES)},
        ),
        max_size=3,
    ),
    VALUES,
)
CHAT = st.fixed_dictionaries(
    {
        "messages": st.one_of(
            st.just([{"role": "user", "content": "Hi"}]),
            st.just(
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
            ),
            MESSAGES,
        ),
        "max_tokens": st.one_of(st.integers(1, 3), st.integers(-2, 3), VALUES),
    },
    optional={
        "model": VALUES,
        "n": SMALL_INTS,
        "temperature": VALUES,
        "stop": VALUES,
        "logprobs": VALUES,
        "top_logprobs": SMALL_INTS,
        "response_format": st.one_of(
            VALUES,
            st.fixed_dictionaries(
                {"type": st.sampled_from(["json_object", "json_schema", "x", "structural_tag"])}
            ),
            st.just({"type": "structural_tag", "format": {"type": "any_text", "excludes": ["!"]}}),
        ),
        "tools": VALUES,
        "tool_choice": VALUES,
        "seed": VALUES,
        "logit_bias": VALUES,
    },
)
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


def post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    """The body as Python's json writes it: NaN and Infinity included (not JSON: a 400)."""
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), headers=headers, timeout=120)


def check(resp: httpx.Response) -> None:
    assert resp.status_code == 200 or 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    if resp.status_code != 200:
        assert resp.json()["error"]["message"], resp.text
        assert "internal error" not in resp.text, resp.text  # a backend bug, not a refusal


@FUZZ
@given(body=NATIVE)
def test_native_generate_answers_every_body(server: Any, body: dict[str, Any]) -> None:
    params = body["sampling_params"]
    if isinstance(params, dict) and "max_new_tokens" not in params:
        params["max_new_tokens"] = 2  # the default (128) would make the fuzz slow
    check(post(server, "/generate", body))


@FUZZ
@given(body=CHAT)
def test_openai_chat_answers_every_body(server: Any, body: dict[str, Any]) -> None:
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3:
        body["max_tokens"] = 3
    check(post(server, "/v1/chat/completions", body))


def test_still_healthy_and_idle_after_the_fuzz(server: Any) -> None:
    assert httpx.get(f"{server.url}/health_generate", timeout=120).status_code == 200
    state = httpx.get(f"{server.url}/server_info", timeout=30).json()["internal_states"][0]
    assert state["num_running"] == 0 and state["num_waiting"] == 0

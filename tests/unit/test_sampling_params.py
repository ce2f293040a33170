"""SamplingParams: defaults, the range rules of sglang-api.md (d), type errors, msgpack."""

from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest

from weft.runtime.sampling_params import SamplingParams

DEFAULTS = {
    "max_new_tokens": 128,
    "min_new_tokens": 0,
    "stop": (),
    "stop_token_ids": (),
    "stop_regex": (),
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "strict_json_schema": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "logit_bias": None,
    "sampling_seed": None,
    "thinking_budget": None,
}


def test_defaults_match_the_table():
    assert SamplingParams().to_dict() == DEFAULTS
    assert SamplingParams.from_dict({}) == SamplingParams()
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert [f.name for f in dataclasses.fields(SamplingParams)] == list(DEFAULTS)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5


@pytest.mark.parametrize("name", [n for n in DEFAULTS if n != "max_new_tokens"])
def test_null_means_default(name):
    assert getattr(SamplingParams.from_dict({name: None}), name) == DEFAULTS[name]


def test_null_max_new_tokens_means_no_limit():
    p = SamplingParams.from_dict({"max_new_tokens": None, "min_new_tokens": 10_000})
    assert p.max_new_tokens is None
    assert p.min_new_tokens == 10_000


VALID = [
    ("max_new_tokens", 0),
    ("max_new_tokens", 4096),
    ("min_new_tokens", 128),
    ("temperature", 0),
    ("temperature", 2.5),
    ("top_p", 1),
    ("top_p", 0.01),
    ("top_k", -1),
    ("top_k", 1),
    ("top_k", 50),
    ("min_p", 0),
    ("min_p", 1),
    ("frequency_penalty", -2),
    ("frequency_penalty", 2),
    ("presence_penalty", -2.0),
    ("presence_penalty", 2.0),
    ("repetition_penalty", 2),
    ("repetition_penalty", 0.01),
    ("n", 4),
    ("stop_token_ids", [0, 7]),
    ("stop_regex", [r"\d+\."]),
    ("regex", "[a-z]+"),
    ("ebnf", 'root ::= "a"'),
    ("logit_bias", {"0": -100, "5": 3.5}),
    ("sampling_seed", 2**64 - 1),
]


@pytest.mark.parametrize(("name", "value"), VALID)
def test_boundary_values_accepted(name, value):
    SamplingParams.from_dict({name: value})


INVALID = [
    ("max_new_tokens", -1, "max_new_tokens must be at least 0"),
    ("min_new_tokens", -1, "min_new_tokens must be in [0, max_new_tokens]"),
    ("min_new_tokens", 129, "min_new_tokens must be in [0, max_new_tokens], got 129"),
    ("temperature", -0.1, "temperature must be finite and at least 0, got -0.1"),
    ("temperature", float("inf"), "temperature must be finite and at least 0, got inf"),
    ("temperature", float("nan"), "temperature must be finite"),
    ("top_p", 0, "top_p must be in (0, 1], got 0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_p", float("nan"), "top_p must be in (0, 1]"),
    ("top_k", 0, "top_k must be -1 (disabled) or at least 1, got 0"),
    ("top_k", -2, "top_k must be -1 (disabled) or at least 1, got -2"),
    ("min_p", -0.5, "min_p must be in [0, 1], got -0.5"),
    ("min_p", 1.01, "min_p must be in [0, 1]"),
    ("frequency_penalty", 2.5, "frequency_penalty must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2], got -3"),
    ("presence_penalty", 2.01, "presence_penalty must be in [-2, 2]"),
    ("presence_penalty", -2.01, "presence_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0, "repetition_penalty must be in (0, 2], got 0"),
    ("repetition_penalty", 2.1, "repetition_penalty must be in (0, 2]"),
    ("n", 0, "n must be at least 1, got 0"),
    ("stop", "", "stop strings must be non-empty"),
    ("stop", ["ok", ""], "stop strings must be non-empty"),
    ("stop_token_ids", [3, -1], "stop_token_ids must be non-negative"),
    ("stop_regex", "(unclosed", "stop_regex pattern '(unclosed' does not compile"),
    ("stop_regex", ["ok", ""], "stop_regex patterns must be non-empty"),
    ("json_schema", "{not json", "json_schema must be valid JSON"),
    ("logit_bias", {"-3": 1.0}, "logit_bias token ids must be non-negative, got -3"),
    ("logit_bias", {5: float("inf")}, "logit_bias for token 5 must be finite"),
    ("sampling_seed", -1, "sampling_seed must be in [0, 2**64)"),
    ("sampling_seed", 2**64, "sampling_seed must be in [0, 2**64)"),
]


@pytest.mark.parametrize(("name", "value", "message"), INVALID)
def test_out_of_range_rejected_naming_the_field(name, value, message):
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({name: value})
    assert name in str(err.value)
    assert message in str(err.value)


@pytest.mark.parametrize(("name", "value", "message"), INVALID)
def test_direct_construction_checks_ranges_too(name, value, message):
    # the dataclass itself (and so msgspec decoding) runs the same range rules
    kwargs = {name: value}
    if name in ("stop", "stop_regex") and isinstance(value, str):
        kwargs = {name: (value,)}
    elif name in ("stop", "stop_regex", "stop_token_ids"):
        kwargs = {name: tuple(value)}
    elif name == "logit_bias":
        kwargs = {name: {int(k): float(v) for k, v in value.items()}}
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_min_new_tokens_checked_against_max_new_tokens():
    SamplingParams.from_dict({"max_new_tokens": 5, "min_new_tokens": 5})
    with pytest.raises(ValueError, match=r"min_new_tokens must be in \[0, max_new_tokens\]"):
        SamplingParams.from_dict({"max_new_tokens": 5, "min_new_tokens": 6})


TYPE_ERRORS = [
    ("temperature", "abc", "temperature must be a number, got 'abc'"),
    ("temperature", True, "temperature must be a number, got True"),
    ("top_p", [0.5], "top_p must be a number"),
    ("repetition_penalty", "1.1", "repetition_penalty must be a number"),
    ("top_k", 5.0, "top_k must be an integer, got 5.0"),
    ("top_k", False, "top_k must be an integer"),
    ("max_new_tokens", "10", "max_new_tokens must be an integer, got '10'"),
    ("n", 1.5, "n must be an integer"),
    ("sampling_seed", "7", "sampling_seed must be an integer"),
    ("ignore_eos", 1, "ignore_eos must be true or false, got 1"),
    ("skip_special_tokens", "yes", "skip_special_tokens must be true or false"),
    ("stop", 5, "stop must be a string or a list of strings, got 5"),
    ("stop", ["a", 1], "stop must be a string or a list of strings"),
    ("stop_regex", {"a": 1}, "stop_regex must be a string or a list of strings"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of token ids"),
    ("stop_token_ids", ["5"], "stop_token_ids must be an integer"),
    ("stop_token_ids", [True], "stop_token_ids must be an integer"),
    ("json_schema", 5, "json_schema must be a JSON string or an object"),
    ("regex", ["a"], "regex must be a string"),
    ("ebnf", 3, "ebnf must be a string"),
    ("logit_bias", [1, 2], "logit_bias must be an object"),
    ("logit_bias", {"abc": 1.0}, "logit_bias keys must be token ids, got 'abc'"),
    ("logit_bias", {"5": "big"}, "logit_bias[5] must be a number"),
    ("logit_bias", {True: 1.0}, "logit_bias keys must be token ids"),
    ("temperature", 10**400, "temperature is out of range"),
]


@pytest.mark.parametrize(("name", "value", "message"), TYPE_ERRORS)
def test_wrong_types_rejected(name, value, message):
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({name: value})
    assert message in str(err.value)


def test_ints_accepted_for_floats():
    p = SamplingParams.from_dict({"temperature": 0, "top_p": 1, "repetition_penalty": 2})
    assert (p.temperature, p.top_p, p.repetition_penalty) == (0.0, 1.0, 2.0)
    assert all(type(v) is float for v in (p.temperature, p.top_p, p.repetition_penalty))


def test_unknown_field_lists_accepted_ones():
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({"temprature": 0.5})
    msg = str(err.value)
    assert "temprature" in msg
    assert "accepted" in msg and "temperature" in msg and "sampling_seed" in msg


def test_not_a_mapping():
    with pytest.raises(ValueError, match="sampling_params must be an object"):
        SamplingParams.from_dict([("temperature", 1.0)])


@pytest.mark.parametrize(
    "grammars",
    [
        {"regex": "a+", "json_schema": "{}"},
        {"regex": "a+", "ebnf": 'root ::= "a"'},
        {"json_schema": {"type": "object"}, "ebnf": 'root ::= "a"'},
        {"regex": "a+", "json_schema": "{}", "ebnf": 'root ::= "a"'},
    ],
)
def test_only_one_grammar(grammars):
    with pytest.raises(ValueError, match=r"^Only one of regex, json_schema, or ebnf can be set\.$"):
        SamplingParams.from_dict(grammars)


def test_json_schema_dict_is_dumped():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = SamplingParams.from_dict({"json_schema": schema})
    assert isinstance(p.json_schema, str)
    assert json.loads(p.json_schema) == schema
    assert SamplingParams.from_dict({"json_schema": '{"type": "string"}'}).json_schema == (
        '{"type": "string"}'
    )


def test_strict_json_schema_needs_a_schema():
    p = SamplingParams.from_dict({"json_schema": {"type": "integer"}, "strict_json_schema": True})
    assert p.strict_json_schema
    with pytest.raises(ValueError, match="strict_json_schema needs a json_schema"):
        SamplingParams.from_dict({"regex": "a+", "strict_json_schema": True})
    tag = {"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a>"]}
    assert SamplingParams.from_dict(
        {"structural_tag": tag, "strict_json_schema": True}
    ).strict_json_schema
    with pytest.raises(ValueError, match="strict_json_schema must be true or false"):
        SamplingParams.from_dict({"json_schema": "{}", "strict_json_schema": "yes"})


def test_stop_shapes():
    assert SamplingParams.from_dict({"stop": "\n"}).stop == ("\n",)
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ("a", "b")
    assert SamplingParams.from_dict({"stop": []}).stop == ()
    assert SamplingParams.from_dict({"stop_regex": r"\d"}).stop_regex == (r"\d",)
    ids = SamplingParams.from_dict({"stop_token_ids": [9, 2, 9]}).stop_token_ids
    assert ids == (2, 9)
    assert SamplingParams.from_dict({"stop_token_ids": {4, 1}}).stop_token_ids == (1, 4)
    assert SamplingParams.from_dict({"stop_token_ids": []}).stop_token_ids == ()


def test_logit_bias_keys_from_json():
    p = SamplingParams.from_dict(json.loads('{"logit_bias": {"12": 5, "3": -1.5}}'))
    assert p.logit_bias == {12: 5.0, 3: -1.5}
    assert SamplingParams.from_dict({"logit_bias": {7: 1}}).logit_bias == {7: 1.0}
    assert SamplingParams.from_dict({"logit_bias": {}}).logit_bias is None


@pytest.mark.parametrize(
    ("temperature", "greedy"),
    [(0.0, True), (1e-7, True), (9.99e-7, True), (1e-6, False), (0.7, False), (1.0, False)],
)
def test_greedy_threshold(temperature, greedy):
    p = SamplingParams.from_dict({"temperature": temperature})
    assert p.is_greedy is greedy
    assert p.temperature == temperature  # greedy is a property: the field is never rewritten
    assert p.top_k == -1


def test_uses_penalties():
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(frequency_penalty=0.5).uses_penalties
    assert SamplingParams(presence_penalty=-0.5).uses_penalties


def test_verify_vocab():
    SamplingParams(stop_token_ids=(0, 99), logit_bias={99: 1.0}).verify_vocab(100)
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 100 is out of vocabulary"):
        SamplingParams(stop_token_ids=(3, 100)).verify_vocab(100)
    with pytest.raises(ValueError, match=r"logit_bias: token id 250 is out of vocabulary"):
        SamplingParams(logit_bias={250: -1.0}).verify_vocab(100)


def test_msgpack_round_trip():
    p = SamplingParams.from_dict(
        {
            "max_new_tokens": None,
            "stop": ["</s>", "\n\n"],
            "stop_token_ids": [2, 7],
            "stop_regex": [r"\d+"],
            "temperature": 0.7,
            "top_k": 40,
            "json_schema": {"type": "object"},
            "logit_bias": {"5": 2.0, "9": -100},
            "sampling_seed": 2**63 + 5,
            "no_stop_trim": True,
        }
    )
    wire = msgspec.msgpack.encode(p)
    back = msgspec.msgpack.decode(wire, type=SamplingParams)
    assert back == p
    assert isinstance(back.stop, tuple) and back.logit_bias == {5: 2.0, 9: -100.0}
    assert msgspec.msgpack.decode(
        msgspec.msgpack.encode(SamplingParams()), type=SamplingParams
    ) == (SamplingParams())


def test_msgpack_decode_runs_range_rules():
    wire = msgspec.msgpack.encode({"top_p": 0.0})
    with pytest.raises(msgspec.ValidationError, match="top_p must be in"):
        msgspec.msgpack.decode(wire, type=SamplingParams)


def test_to_dict_round_trip():
    p = SamplingParams.from_dict({"stop": "x", "logit_bias": {"1": 1}, "temperature": 0})
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert json.loads(json.dumps(p.to_dict()))["stop"] == ["x"]

"""The shipped corpus on every backend: valid text passes the mask token by token, invalid is blocked."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from test_constrain_support import (
    compile_spec,
    encode,
    prefetch_corpus,
    regexes,
    schemas,
    strip_keywords,
    tokenizer,
    walk,
)

from weft.constrain import BACKENDS, GrammarError, GrammarSpec

# Refusals each backend must give (entry -> words the message must contain). outlines may also
# refuse any entry with "timed out" (outlines-core needs 15-40 s for 3 corpus schemas).
REFUSED: dict[str, dict[str, str]] = {
    "llguidance": {},
    "outlines": {
        "recursive_tree": "recursive $ref",
        "all_of_merge": "closes objects",
        "escaped_property_names": "property name",
        "open_object_extra": "closes objects",
        "any_object": "arbitrary JSON object",
        "any_array": "arbitrary JSON array",
    },
}
# Valid texts a backend blocks: documented departures (entry, text) -> why. Asserted exactly, so a
# fixed upstream bug shows up as a failure to update this table.
DEPARTURES: dict[str, dict[tuple[str, str], str]] = {
    "llguidance": {},
    "outlines": {
        ("numbers_forms", "[1E5, 2e-3, -0.0]"): "outlines-core requires a sign in exponents (1e+5)",
    },
}


@pytest.fixture(scope="module", autouse=True)
def _prefetch() -> None:
    """outlines compiles take seconds: run them in the background while llguidance is tested."""
    prefetch_corpus("outlines")


def _validator(schema: Any) -> jsonschema.protocols.Validator:
    cls = jsonschema.Draft202012Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _is_instance(text: str, schema: Any) -> bool:
    try:
        value = json.loads(text, parse_constant=lambda c: 1 / 0)
    except (json.JSONDecodeError, ZeroDivisionError):
        return False
    return bool(_validator(schema).is_valid(value))


def test_corpus_is_sound() -> None:
    """The corpus itself: >= 40 schemas and >= 30 regexes, instances verified independently."""
    entries = schemas()
    assert len(entries) >= 40 and len(regexes()) >= 30
    features = {f for e in entries for f in e["features"]}
    for needed in (
        "nested",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "$ref",
        "$defs",
        "anyOf",
        "oneOf",
        "format",
        "pattern",
        "minimum",
        "optional",
    ):
        assert needed in features, needed
    for e in entries:
        jsonschema.Draft202012Validator.check_schema(e["schema"])
        for text in _valid_texts(e):
            assert _is_instance(text, e["schema"]), (e["name"], text)
        for text in _invalid_texts(e):
            assert not _is_instance(text, e["schema"]), (e["name"], text)
    for r in regexes():
        assert all(re.fullmatch(r["pattern"], s) for s in r["valid"]), r["name"]
        assert not any(re.fullmatch(r["pattern"], s) for s in r["invalid"]), r["name"]


def _valid_texts(entry: dict[str, Any]) -> list[str]:
    texts = [json.dumps(v, ensure_ascii=False) for v in entry["valid"]]
    texts.append(json.dumps(entry["valid"][0], ensure_ascii=False, indent=2))
    return texts + entry["valid_text"]


def _invalid_texts(entry: dict[str, Any]) -> list[str]:
    return [json.dumps(v, ensure_ascii=False) for v in entry["invalid"]] + entry["invalid_text"]


def _compile_or_skip(backend: str, name: str, spec: GrammarSpec) -> Any:
    try:
        return compile_spec(backend, spec)
    except GrammarError as e:
        expected = REFUSED[backend].get(name)
        timed_out = backend == "outlines" and "timed out" in str(e)
        assert timed_out or (expected is not None and expected in str(e)), (
            f"unexpected refusal: {e}"
        )
        pytest.skip(f"{backend} refuses {name}: {e}")


def _check_valid(backend: str, name: str, grammar: Any, text: str, fits: Any) -> str | None:
    """None if `text` passes; else the failure. `fits(prefix)` judges early stop points."""
    result = walk(grammar.matcher(), encode(text))
    assert not result.forced_mismatch, (
        f"{text!r}: forced tokens not token-exact at {result.forced_mismatch}"
    )
    ids = encode(text)
    for step in result.early_stops:
        prefix = tokenizer().decode(ids[:step])
        assert fits(prefix), f"{text!r}: stop allowed after the non-match {prefix!r}"
    if result.accepted:
        return None
    where = "at the end (no stop)" if result.blocked_at is None else f"at token {result.blocked_at}"
    return f"{name}: valid {text!r} blocked {where}"


@pytest.mark.parametrize("entry", schemas(), ids=lambda e: e["name"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_schema_corpus(backend: str, entry: dict[str, Any]) -> None:
    name, schema = entry["name"], entry["schema"]
    grammar = _compile_or_skip(backend, name, GrammarSpec.json_schema(schema))
    assert name not in REFUSED[backend], f"{backend} was expected to refuse {name}"
    enforced = strip_keywords(schema, grammar.unenforced)
    for keyword in grammar.unenforced:
        assert keyword.split(":")[0] in json.dumps(schema), f"spurious unenforced {keyword!r}"

    def fits(prefix: str) -> bool:
        return _is_instance(prefix, enforced)

    blocked = {}
    for text in _valid_texts(entry):
        failure = _check_valid(backend, name, grammar, text, fits)
        if failure is not None:
            blocked[(name, text)] = failure
    known = {k: v for k, v in DEPARTURES[backend].items() if k[0] == name}
    assert blocked.keys() == known.keys(), f"blocked valid texts {blocked} != departures {known}"
    for text in _invalid_texts(entry):
        if walk(grammar.matcher(), encode(text)).accepted:
            assert _is_instance(text, enforced), f"{name}: invalid {text!r} accepted"


@pytest.mark.parametrize("entry", regexes(), ids=lambda e: e["name"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_corpus(backend: str, entry: dict[str, Any]) -> None:
    name, pattern = entry["name"], entry["pattern"]
    grammar = _compile_or_skip(backend, name, GrammarSpec.regex(pattern))

    def fits(prefix: str) -> bool:
        return re.fullmatch(pattern, prefix) is not None

    blocked = {}
    for text in entry["valid"]:
        failure = _check_valid(backend, name, grammar, text, fits)
        if failure is not None:
            blocked[(name, text)] = failure
    known = {k: v for k, v in DEPARTURES[backend].items() if k[0] == name}
    assert blocked.keys() == known.keys(), f"blocked valid texts {blocked} != departures {known}"
    for text in entry["invalid"]:
        assert not walk(grammar.matcher(), encode(text)).accepted, (
            f"{name}: invalid {text!r} accepted"
        )

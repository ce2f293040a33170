"""Matcher semantics on both backends: stop ids, special and padded ids, forcing, copy, rollback."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_constrain_support import (
    STOP,
    VOCAB,
    allowed_ids,
    backend,
    compile_spec,
    encode,
    schemas,
    walk,
)

from weft.constrain import (
    BACKENDS,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    allocate_bitmask,
)

CONST_SCHEMA = {
    "type": "object",
    "properties": {"version": {"const": "v1.2.3-alpha"}, "n": {"type": "integer"}},
    "required": ["version", "n"],
    "additionalProperties": False,
}


def matcher(name: str, spec: GrammarSpec) -> GrammarMatcher:
    return compile_spec(name, spec).matcher()


def mask_of(m: GrammarMatcher, vocab_size: int = VOCAB) -> np.ndarray:
    bitmask = allocate_bitmask(1, vocab_size)
    m.fill_bitmask(bitmask, 0)
    return allowed_ids(bitmask)


def feed(m: GrammarMatcher, text: str) -> None:
    for token in encode(text):
        assert m.accept_token(token), (text, token)


@pytest.mark.parametrize("name", BACKENDS)
def test_stop_id_exactly_at_the_end(name: str) -> None:
    m = matcher(name, GrammarSpec.regex("ab(cd)?"))
    assert STOP not in mask_of(m) and not m.accept_token(STOP)
    feed(m, "ab")
    assert STOP in mask_of(m)  # "ab" is a complete match, "abcd" may follow
    feed(m, "cd")
    assert list(mask_of(m)) == [STOP], "after the last possible char only the stop id"
    assert m.accept_token(STOP) and m.is_terminated()
    assert not m.accept_token(encode("a")[0]) and m.forced_tokens() == []
    assert list(mask_of(m)) == [STOP], "after it ended only the stop id"


@pytest.mark.parametrize("name", BACKENDS)
def test_every_stop_id_and_no_special_token_inside_content(name: str) -> None:
    from test_constrain_support import tokenizer

    from weft.constrain import create_grammar_backend

    be = create_grammar_backend(name, tokenizer(), VOCAB, [STOP, 0])
    m = be.compile(GrammarSpec.json_schema({"type": "string"})).matcher()
    feed(m, '"a')
    inside = set(mask_of(m).tolist())
    assert len(inside) > 1000 and not inside & set(range(17)), "no special/stop id inside a string"
    feed(m, '"')
    assert set(mask_of(m).tolist()) == {0, STOP}
    be.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_padded_vocab_columns_are_masked(name: str) -> None:
    padded = VOCAB + 100  # a model whose logit rows outnumber the tokenizer's tokens
    m = (
        backend(name, vocab_size=padded)
        .compile(GrammarSpec.json_schema({"type": "string"}))
        .matcher()
    )
    for text in ('"', "abc", '"'):
        ids = mask_of(m, padded)
        assert ids.size and ids.max() < VOCAB
        feed(m, text)
    assert list(mask_of(m, padded)) == [STOP]


@pytest.mark.parametrize("name", BACKENDS)
def test_forced_tokens_are_token_exact(name: str) -> None:
    """Each forced token is the only token its step's mask allows (so forcing changes nothing)."""
    cases = [(GrammarSpec.regex(r"\x07{3}x(y|z)"), "", 3)]
    if name == "llguidance":  # its mask keeps the canonical tokenization of forced text
        cases.append((GrammarSpec.json_schema(CONST_SCHEMA), '{"version": "', 8))
    for spec, prefix, min_forced in cases:
        m = matcher(name, spec)
        feed(m, prefix)
        forced = m.forced_tokens()
        assert len(forced) >= min_forced, forced
        for token in forced:
            assert list(mask_of(m)) == [token]
            assert m.accept_token(token)
        assert len(mask_of(m)) > 1 and m.forced_tokens() == []


@pytest.mark.parametrize("name", BACKENDS)
def test_rejected_token_leaves_state_unchanged(name: str) -> None:
    m = matcher(name, GrammarSpec.json_schema(CONST_SCHEMA))
    feed(m, '{"version": "v1.2')
    before = mask_of(m)
    assert not m.accept_token(encode("x")[0])
    assert not m.accept_token(1), "<|im_start|> is never content"
    assert np.array_equal(mask_of(m), before)


@pytest.mark.parametrize("name", BACKENDS)
def test_copy_is_independent(name: str) -> None:
    m = matcher(
        name, GrammarSpec.json_schema({"type": "array", "items": {"enum": ["red", "green"]}})
    )
    feed(m, '["red", ')
    fork = m.copy()
    feed(m, '"green"]')
    assert m.accept_token(STOP) and m.is_terminated()
    assert not fork.is_terminated() and STOP not in mask_of(fork)
    feed(fork, '"red", "red"]')
    assert fork.accept_token(STOP)
    again = m.copy()
    assert again.is_terminated() and list(mask_of(again)) == [STOP]


@pytest.mark.parametrize("name", BACKENDS)
def test_rollback_restores_masks(name: str) -> None:
    m = matcher(name, GrammarSpec.json_schema(CONST_SCHEMA))
    ids = encode('{"version": "v1.2.3-alpha", "n": 42}')
    masks = []
    for token in ids:
        masks.append(mask_of(m))
        assert m.accept_token(token)
    assert m.accept_token(STOP) and m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated() and STOP in mask_of(m)
    m.rollback(5)
    assert np.array_equal(mask_of(m), masks[len(ids) - 5])
    m.rollback(len(ids) - 5)
    assert np.array_equal(mask_of(m), masks[0])
    feed(m, '{"version": "v1.2.3-alpha", "n": 7}')
    assert m.accept_token(STOP)


@pytest.mark.parametrize("name", BACKENDS)
def test_choices(name: str) -> None:
    spec = GrammarSpec.choices(["yes", "no", "a+b (c)"])
    for text in ("yes", "no", "a+b (c)"):
        assert walk(matcher(name, spec), encode(text)).accepted, text
    for text in ("ye", "nope", "ab (c)"):
        assert not walk(matcher(name, spec), encode(text)).accepted, text


def test_json_object_and_whitespace_bound() -> None:
    """(outlines-core needs ~40 s for json_object: the compiler's timeout refuses it.)"""
    name, spec = "llguidance", GrammarSpec.json_object()
    assert walk(matcher(name, spec), encode('{"a": [1, {"b": null}]}')).accepted
    for text in ("[1]", '"s"', ' {"a": 1}', '{"a": 1} '):
        assert not walk(matcher(name, spec), encode(text)).accepted, text
    assert walk(matcher(name, spec), encode("{" + " " * 16 + '"a": 1}')).accepted
    assert not walk(matcher(name, spec), encode("{" + " " * 17 + '"a": 1}')).accepted


def test_ebnf_on_llguidance_refused_by_outlines() -> None:
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]+/'
    gbnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'
    for grammar in (lark, gbnf):
        spec = GrammarSpec.ebnf(grammar)
        assert walk(matcher("llguidance", spec), encode("(1+22+3)")).accepted
        assert not walk(matcher("llguidance", spec), encode("(1+)")).accepted
    with pytest.raises(GrammarError, match="does not support ebnf"):
        backend("outlines").compile(GrammarSpec.ebnf(lark))
    with pytest.raises(GrammarError, match="unknown name"):
        backend("llguidance").compile(GrammarSpec.ebnf('start: "a" oops'))


@pytest.mark.parametrize("name", BACKENDS)
def test_a_keyword_left_unenforced_twice_is_reported_once(name: str) -> None:
    """llguidance words a repeated warning 'Unimplemented keys: [...] (2 times)'."""
    arr = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    schema = {"type": "object", "properties": {"a": arr, "b": arr}, "additionalProperties": False}
    assert backend(name).compile(GrammarSpec.json_schema(schema)).unenforced == ("uniqueItems",)
    with pytest.raises(GrammarError, match="uniqueItems"):
        backend(name, strict=True).compile(GrammarSpec.json_schema(schema))


@pytest.mark.parametrize("name", BACKENDS)
def test_strict_refuses_what_lenient_reports(name: str) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    lenient = backend(name).compile(GrammarSpec.json_schema(schema))
    assert lenient.unenforced == ("uniqueItems",)
    with pytest.raises(GrammarError, match="uniqueItems"):
        lenient.require_enforced()  # per-request strict on a lenient backend
    with pytest.raises(GrammarError, match="uniqueItems") as info:
        backend(name, strict=True).compile(GrammarSpec.json_schema(json.dumps(schema)))
    assert info.value.keywords == ("uniqueItems",)
    exact = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 3}},
        "required": ["a"],
        "additionalProperties": False,  # outlines closes objects: an open one is refused
    }
    assert backend(name, strict=True).compile(GrammarSpec.json_schema(exact)).unenforced == ()
    # per request (OpenAI strict: true) on a lenient backend: the same refusal, saying why
    with pytest.raises(GrammarError, match="uniqueItems.*strict is true") as info:
        backend(name).compile(GrammarSpec.json_schema(schema, strict=True))
    assert info.value.keywords == ("uniqueItems",)
    assert backend(name).compile(GrammarSpec.json_schema(exact, strict=True)).unenforced == ()


def test_per_request_strict_refuses_exactly_what_lenient_reports() -> None:
    """Over the whole corpus (llguidance, the default): a strict spec is refused, naming the
    keywords, iff the lenient compile of that schema reports unenforced keywords."""
    lenient = backend("llguidance")
    for entry in schemas():
        reported = lenient.compile(GrammarSpec.json_schema(entry["schema"])).unenforced
        try:
            lenient.compile(GrammarSpec.json_schema(entry["schema"], strict=True))
        except GrammarError as e:
            assert reported and set(e.keywords) == set(reported), (entry["name"], e, reported)
        else:
            assert not reported, (entry["name"], reported)


def test_strict_is_part_of_the_spec_and_its_cache_key() -> None:
    spec = GrammarSpec.json_schema({"type": "integer", "minimum": 3})
    strict = GrammarSpec.json_schema({"type": "integer", "minimum": 3}, strict=True)
    assert spec != strict and spec.spec == strict.spec
    with pytest.raises(GrammarError, match="strict applies to json_schema and structural_tag"):
        GrammarSpec("regex", "a+", strict=True)
    compiler = GrammarCompiler(backend("outlines"), timeout_s=10, threads=1)
    try:
        assert compiler.submit(spec).result().unenforced == ("minimum",)
        with pytest.raises(GrammarError, match="minimum.*strict is true"):
            compiler.submit(strict).result()
        assert compiler.misses == 2
    finally:
        compiler.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_invalid_specs_are_refused(name: str) -> None:
    with pytest.raises(GrammarError):
        backend(name).compile(GrammarSpec.regex("(unclosed"))
    with pytest.raises(GrammarError):
        GrammarSpec.json_schema("{not json")
    with pytest.raises(GrammarError):
        GrammarSpec.choices([])
    with pytest.raises(GrammarError):
        GrammarSpec("yaml", "")
    with pytest.raises(GrammarError, match="allows no value"):
        GrammarSpec.json_schema(False)
    assert GrammarSpec.json_schema(True).spec == "{}"
    assert GrammarSpec.json_schema({"b": 1, "a": 2}).spec == '{"b":1,"a":2}'  # order is semantic


def test_an_unknown_dialect_is_reported_or_refused() -> None:
    """llguidance cannot resolve a `$schema` it does not know (SchemaStore's stricter draft-07
    meta-schema): lenient compiles the schema under the default dialect and says `$schema` was
    not enforced; strict refuses it; a known dialect is simply used."""
    body = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    unknown = {"$schema": "https://json.schemastore.org/metaschema-draft-07-unofficial-strict.json"}
    lenient = backend("llguidance").compile(GrammarSpec.json_schema({**unknown, **body}))
    assert lenient.unenforced == ("$schema",)
    assert walk(lenient.matcher(), encode('{"n": 3}')).accepted
    assert not walk(lenient.matcher(), encode('{"n": "x"}')).accepted
    with pytest.raises(GrammarError, match="unknown JSON Schema dialect") as info:
        backend("llguidance").compile(GrammarSpec.json_schema({**unknown, **body}, strict=True))
    assert info.value.keywords == ("$schema",)
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **body}
    assert (
        backend("llguidance", strict=True).compile(GrammarSpec.json_schema(draft7)).unenforced == ()
    )


def test_a_remote_ref_is_refused_with_the_reason_if_strict() -> None:
    """Lenient drops it and reports it (test_llguidance_repairs.py)."""
    schema = {"type": "object", "properties": {"a": {"$ref": "https://example.com/other.json"}}}
    with pytest.raises(GrammarError, match="remote \\$ref 'https://example.com/other.json' is not "
                       "supported: weft does not fetch"):  # fmt: skip
        backend("llguidance", strict=True).compile(GrammarSpec.json_schema(schema))

"""GrammarCompiler (timeouts, cache, cached failures), bitmask application and vocabulary kinds."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch
from test_constrain_support import backend, encode, walk

from weft.constrain import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    allocate_bitmask,
    apply_bitmask,
    create_grammar_backend,
)
from weft.constrain.vocab import TokenSpace, token_bytes_table, vocab_kind


class _Grammar(CompiledGrammar):
    def matcher(self) -> GrammarMatcher:
        raise NotImplementedError


class CountingBackend(GrammarBackend):
    """Counts compiles; refuses regex "(", sleeps on "slow"."""

    name = "counting"

    def __init__(self) -> None:
        super().__init__(TokenSpace(64, 64, [0], [], "fake"), strict=False)
        self.compiles = 0

    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> CompiledGrammar:
        self.compiles += 1
        if spec.spec == "(":
            raise GrammarError("invalid regex: unclosed group")
        if spec.spec == "slow":
            time.sleep(0.6)
        if spec.spec == "bug":
            raise KeyError("a bug in the backend")
        return _Grammar(spec)


def test_cache_hits_and_lru_eviction() -> None:
    fake = CountingBackend()
    compiler = GrammarCompiler(fake, timeout_s=5, cache_size=2)
    first = compiler.submit(GrammarSpec.json_schema({"type": "string"}))
    again = compiler.submit(GrammarSpec.json_schema('{"type": "string"}'))  # same canonical text
    assert again is first and first.result() is again.result()
    assert (compiler.hits, compiler.misses, fake.compiles) == (1, 1, 1)
    compiler.submit(GrammarSpec.regex("a")).result()
    compiler.submit(GrammarSpec.regex("b")).result()  # evicts the schema (least recently used)
    compiler.submit(GrammarSpec.json_schema({"type": "string"})).result()
    assert fake.compiles == 4
    compiler.close()


def test_failures_are_cached() -> None:
    fake = CountingBackend()
    compiler = GrammarCompiler(fake, timeout_s=5)
    for _ in range(3):
        with pytest.raises(GrammarError, match="unclosed"):
            compiler.submit(GrammarSpec.regex("(")).result()
    assert fake.compiles == 1 and compiler.hits == 2
    compiler.close()


def test_a_backend_bug_is_a_refusal_of_that_spec_not_a_crash() -> None:
    """A non-GrammarError from a backend (a bug) reaches the caller as a GrammarError naming it,
    so the scheduler's grammar queue refuses that request and serves the others."""
    compiler = GrammarCompiler(CountingBackend(), timeout_s=5)
    with pytest.raises(GrammarError, match="internal error in the counting grammar backend "
                       "\\(KeyError: 'a bug in the backend'\\)"):  # fmt: skip
        compiler.submit(GrammarSpec.regex("bug")).result()
    assert isinstance(compiler.submit(GrammarSpec.regex("a")).result(), _Grammar)
    compiler.close()


def test_llguidance_warnings_name_the_keywords() -> None:
    from weft.constrain.schema import llguidance_keywords

    got = llguidance_keywords([
        'Unimplemented keys: ["uniqueItems"] (2 times)',  # a repeated warning (real-world schemas)
        'Unimplemented keys: ["if", "then"]',
        "Unknown format: hostname",
        "Unknown format: regex (3 times)",
        "Unimplemented keys: not a list",
    ])  # fmt: skip
    assert got == ["uniqueItems", "if", "then", "format:hostname", "format:regex",
                   "Unimplemented keys: not a list"]  # fmt: skip


def test_handle_polling_and_late_results_count_as_timeouts() -> None:
    compiler = GrammarCompiler(CountingBackend(), timeout_s=0.3)
    handle = compiler.submit(GrammarSpec.regex("slow"))
    assert not handle.done()
    with pytest.raises(TimeoutError):
        handle.result(wait_s=0.05)
    start = time.monotonic()
    with pytest.raises(GrammarError, match="timed out after 0.3 s"):
        handle.result()
    assert time.monotonic() - start < 0.4
    time.sleep(0.5)  # the compile finishes late: still a (cached) timeout
    assert handle.done() and handle.elapsed_s is not None and handle.elapsed_s > 0.3
    with pytest.raises(GrammarError, match="timed out"):
        compiler.submit(GrammarSpec.regex("slow")).result()
    compiler.close()


def test_outlines_timeout_kills_the_compile_and_the_compiler_stays_usable() -> None:
    compiler = GrammarCompiler(backend("outlines"), timeout_s=1.0, cache_size=8)
    start = time.monotonic()
    blowup = compiler.submit(GrammarSpec.regex("(a|b)*a(a|b){24}"))  # 2^24 DFA states
    other = compiler.submit(GrammarSpec.regex("[0-9]{3}"))
    assert walk(other.result().matcher(), encode("123")).accepted
    with pytest.raises(GrammarError, match="timed out after 1 s"):
        blowup.result()
    assert time.monotonic() - start < 2.0
    after = compiler.submit(GrammarSpec.choices(["after", "timeout"])).result()
    assert walk(after.matcher(), encode("timeout")).accepted


def test_llguidance_adversarial_specs_fail_fast() -> None:
    compiler = GrammarCompiler(backend("llguidance"), timeout_s=0.5, cache_size=8)
    deep: dict[str, object] = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "array", "items": deep}
    start = time.monotonic()
    huge_enum = GrammarSpec.json_schema(
        {"enum": [f"item-{i}-{i * 7919 % 100003}" for i in range(200_000)]}
    )
    with pytest.raises(GrammarError, match="nests 301 levels deep"):
        GrammarSpec.json_schema(deep)  # refused where the spec is made; the compiler checks too:
    raw_deep = GrammarSpec("json_schema", json.dumps(deep))
    handles = [compiler.submit(raw_deep), compiler.submit(huge_enum)]
    handles.append(compiler.submit(GrammarSpec.regex(r"(x+x+)+y|(a|aa)*b")))
    with pytest.raises(GrammarError, match="nests 301 levels deep; the limit is 128"):
        handles[0].result()
    with pytest.raises(GrammarError, match="timed out|too"):
        handles[1].result()
    assert time.monotonic() - start < 1.5
    catastrophic = handles[2].result()  # a lazy lexer: no blow-up for backtracking regexes
    assert walk(catastrophic.matcher(), encode("xxxxxxxxxxxxxxxxxxxxxxxxy")).accepted


def test_apply_bitmask_cpu() -> None:
    logits = torch.zeros(3, 70)
    bitmask = allocate_bitmask(2, 64)  # narrower than the logits: columns 64.. are disallowed
    bitmask.zero_()
    bitmask[0, 0] = 1 << 5
    bitmask[1, 1] = -(2**31)  # bit 63
    apply_bitmask(logits, bitmask, rows=torch.tensor([0, 2]))
    assert logits[1].eq(0).all(), "an unconstrained row is untouched"
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5]
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [63]
    full = torch.randn(2, 40)
    mask = allocate_bitmask(2, 40)
    mask[1, 1] = 0  # disallow 32..39 in row 1
    apply_bitmask(full, mask)
    assert torch.isfinite(full[0]).all() and torch.isinf(full[1, 32:]).all()


def _sentencepiece_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ("▁", "a", "b", "▁a", "ab", "▁ab"):
        vocab[piece] = len(vocab)
    model = models.BPE(
        vocab, [("▁", "a"), ("a", "b"), ("▁a", "b")], unk_token="<unk>", byte_fallback=True
    )
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.mark.parametrize("name", ["llguidance", "outlines"])
def test_sentencepiece_byte_fallback_vocab(name: str) -> None:
    tok = _sentencepiece_tokenizer()
    assert vocab_kind(tok) == "sentencepiece"
    table = token_bytes_table(tok)
    assert table[:3] == [None, None, None] and table[3 + 10] == b"\n" and table[-1] == b" ab"
    be = create_grammar_backend(name, tok, 288, [2])  # 270 tokens, padded to 288 logits
    grammar = be.compile(GrammarSpec.regex("ab a\nb"))
    ids = tok.encode("ab a\nb", add_special_tokens=False)  # ab, ▁a, <0x0A>, b
    m = grammar.matcher()
    bitmask = allocate_bitmask(1, 288)
    for token in ids:
        m.fill_bitmask(bitmask, 0)
        assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1
        assert m.accept_token(token)
    assert m.accept_token(2) and m.is_terminated()
    be.close()


def test_unknown_backend_and_bad_vocab_sizes() -> None:
    tok = _sentencepiece_tokenizer()
    with pytest.raises(ValueError, match="unknown grammar backend"):
        create_grammar_backend("xgrammar", tok, 288, [2])
    with pytest.raises(ValueError, match="only 100 logits"):
        create_grammar_backend("llguidance", tok, 100, [2])
    with pytest.raises(ValueError, match="stop ids"):
        create_grammar_backend("llguidance", tok, 288, [])


def test_a_space_allowing_structure_tokens_keeps_the_rest() -> None:
    """`allowing`: the structure ids become maskable like content, the other special ids stay
    never-content, stops and the fingerprint (the tokenizer's) are unchanged."""
    space = TokenSpace(96, 70, [0, 1], [5, 6, 7], "tok")
    tagged = space.allowing([6])
    assert tagged.fingerprint == space.fingerprint and tagged.stop_ids == space.stop_ids
    assert tagged.special_ids == {5, 7} and space.special_ids == {5, 6, 7}
    assert space.allowing([]) is space
    row = torch.full((space.words,), -1, dtype=torch.int32)
    tagged.mask_non_content(row.data_ptr())
    allowed = {t for t in range(96) if (int(row[t // 32]) >> (t % 32)) & 1}
    assert allowed == set(range(2, 70)) - {5, 7}

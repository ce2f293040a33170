"""`\\d` is `[0-9]` in every backend path (as xgrammar and SGLang read it): the mask after a `\\d`
never allows a token that starts U+1FBF0 (SEGMENTED DIGIT ZERO) or an Arabic-Indic digit. `\\w` and
`\\s` are Python's ASCII classes likewise (tests/unit/test_constrain_ascii_classes.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from weft.constrain import GrammarSpec, allocate_bitmask, create_grammar_backend
from weft.constrain.vocab import token_bytes_table
from weft.runtime.loader import load_tokenizer

# the byte-level tokens that begin U+1FBF0 (f0 9f af b0) and U+0660..U+0669 (d9 a0..d9 a9)
FOREIGN_LEADS = (b"\xf0", b"\xd9")
WORD = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_"
SPACE = b" \t\n\r\x0b\x0c"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def backends(tokenizer: Any) -> Iterator[dict[str, Any]]:
    made = {
        name: create_grammar_backend(
            name, tokenizer, len(tokenizer), {tokenizer.eos_token_id}, prefetch_masks=False
        )
        for name in ("llguidance", "outlines")
    }
    yield made
    for backend in made.values():
        backend.close()


def allowed_bytes(
    backend: Any, tokenizer: Any, spec: GrammarSpec, prefix: list[int]
) -> dict[int, bytes]:
    matcher = backend.compile(spec).matcher()
    for token in prefix:
        assert matcher.accept_token(token)
    bitmask = allocate_bitmask(1, backend.space.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    table = token_bytes_table(tokenizer)
    words = bitmask[0].tolist()
    return {
        i: data
        for i, data in enumerate(table)
        if data is not None and (words[i // 32] >> (i % 32)) & 1
    }


CASES = [
    ("regex", GrammarSpec.regex(r"\d+"), "", b"0123456789"),
    ("class", GrammarSpec.regex(r"[\d_]+"), "", b"0123456789_"),
    (
        "schema pattern",
        GrammarSpec.json_schema({"type": "string", "pattern": r"^\d+$"}),
        '"',
        b"0123456789",
    ),
    ("ebnf regex", GrammarSpec.ebnf(r"start: /\d+/"), "", b"0123456789"),
    (
        "structural tag",
        GrammarSpec.structural_tag({"format": {"type": "regex", "pattern": r"\d{1,5}"}}),
        "",
        b"0123456789",
    ),
    ("word regex", GrammarSpec.regex(r"\w+"), "", WORD),
    ("word class", GrammarSpec.regex(r"[\w-]+"), "", WORD + b"-"),
    ("space regex", GrammarSpec.regex(r"x\s+"), "x", SPACE),
    (
        "word schema pattern",
        GrammarSpec.json_schema({"type": "string", "pattern": r"^\w+$"}),
        '"',
        WORD + b'"',  # a word character may close the string: tokens such as `_"`
    ),
    ("word ebnf regex", GrammarSpec.ebnf(r"start: /\w+/"), "", WORD),
]


@pytest.mark.parametrize("name", ["llguidance", "outlines"])
@pytest.mark.parametrize(("what", "spec", "before", "chars"), CASES, ids=[c[0] for c in CASES])
def test_d_allows_ascii_digits_only(
    tokenizer: Any,
    backends: dict[str, Any],
    name: str,
    what: str,
    spec: GrammarSpec,
    before: str,
    chars: bytes,
) -> None:
    if name == "outlines" and spec.kind in ("ebnf", "structural_tag"):
        pytest.skip("outlines compiles neither EBNF nor structural tags")
    table = token_bytes_table(tokenizer)
    leads = [table.index(b) for b in FOREIGN_LEADS]  # they exist: the check below can fail
    prefix = tokenizer.encode(before, add_special_tokens=False) if before else []
    allowed = allowed_bytes(backends[name], tokenizer, spec, prefix)
    assert allowed, what
    assert not set(leads) & set(allowed), what
    assert all(set(data) <= set(chars) for data in allowed.values()), (
        what,
        sorted(d for d in allowed.values() if not set(d) <= set(chars))[:8],
    )

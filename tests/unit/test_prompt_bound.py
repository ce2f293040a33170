"""The length bound that refuses a text prompt untokenized: sound only for byte-level BPE without a
normalizer (none otherwise), and a refusal names both numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import save_byte_tokenizer, save_word_tokenizer
from transformers import AutoTokenizer

from weft.runtime.server.limits import check_text_fits, max_chars_per_token


def test_byte_level_bpe_has_a_bound_that_holds(tmp_path: Path) -> None:
    save_byte_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    bound = max_chars_per_token(tok)
    assert bound == max(len(s) for s in tok.get_vocab())  # "<pad>", "</s>": 5 characters
    for text in ("héllo wörld " * 50, "</s>" * 40, "\u4e2d\u6587" * 30):
        assert len(tok.encode(text)) >= len(text) / bound  # the bound never over-refuses


def test_other_tokenizers_have_no_bound(tmp_path: Path) -> None:
    save_word_tokenizer(tmp_path, 64)  # one [unk] may stand for a word of any length
    assert max_chars_per_token(AutoTokenizer.from_pretrained(tmp_path)) is None
    assert max_chars_per_token(None) is None


def test_refusal_names_the_numbers() -> None:
    check_text_fits("x" * 100, 10, 10)  # 100 characters may be 10 tokens: not refused
    check_text_fits("x" * 10**6, None, 10)  # no bound: the tokenizer decides
    with pytest.raises(ValueError, match=r"at least 11 tokens: 101 characters, at most 10 per "
                       r"token\) is longer than the model's context length \(10 tokens\)"):  # fmt: skip
        check_text_fits("x" * 101, 10, 10)

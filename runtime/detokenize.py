"""Incremental detokenization: a growing list of token ids -> stable text, equal to a one-shot decode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"  # what a decode shows for an incomplete (or invalid) UTF-8 sequence
MAX_HELD_TOKENS = 64  # NOTE: bounds one push's cost when the text stays incomplete (see below)


def one_shot_texts(tokenizer: Any, items: Sequence[tuple[Sequence[int], Sequence[int]]],
                   skip_special_tokens: bool) -> list[str] | None:  # fmt: skip
    """The texts IncrementalDecoder(prefix_ids=prefix).finish(ids) gives for each (prefix, ids),
    in two batched calls of the Rust tokenizer (parallel over the cores where it may be), or
    None when the tokenizer's decode is not exactly that call (not a stock fast tokenizer).

    NOTE: a stock fast tokenizer's decode with clean_up_tokenization_spaces=False is
    backend_tokenizer.decode(ids, skip_special_tokens) (spaces_between_special_tokens applies to
    slow tokenizers only); per output, transformers' decode first checks every id in Python.
    1,024 finished outputs of 256 tokens decoded one by one took ~0.4 s on the 2-core VM."""
    from transformers import PreTrainedTokenizerFast

    stock = PreTrainedTokenizerFast
    if type(tokenizer).decode is not stock.decode or type(tokenizer)._decode is not stock._decode:
        return None
    backend = tokenizer.backend_tokenizer
    prefixes = [list(p) for p, _ in items]
    surr = backend.decode_batch([p for p in prefixes if p], skip_special_tokens=skip_special_tokens)
    heads = iter(surr)
    contexts = [next(heads) if p else "" for p in prefixes]
    seqs = []
    for i, (prefix, (_, ids)) in enumerate(zip(prefixes, items, strict=True)):
        if contexts[i].endswith(REPLACEMENT_CHAR):  # as IncrementalDecoder: decode without it
            prefix, contexts[i] = [], ""
        seqs.append(prefix + list(ids))
    texts = backend.decode_batch(seqs, skip_special_tokens=skip_special_tokens)
    return [text[len(c) :] for text, c in zip(texts, contexts, strict=True)]


class IncrementalDecoder:
    """Turns a growing list of token ids into text, emitting only stable text.

    The window technique of vLLM/TGI/SGLang: the decoder keeps the tokens of the last emitted
    delta (`window[:read]`, whose text `surr_text` is already out) and the tokens not yet emitted
    (`window[read:]`). A push decodes the window once and emits what lies past `surr_text`:

        window:  [ ...emitted last time... | ...held... | new ids ]
                 0                       read                   len
        delta  = decode(window)[len(surr_text):]

    The delta is held back while it is empty or ends with U+FFFD (a character split across
    tokens). When it is emitted the window drops `window[:read]`, so a push costs O(window), not
    O(total). Decoding the previous delta's tokens again gives each new token its left context,
    which sentencepiece (`▁`, Strip decoder) tokenizers need for their leading space.

    Guarantee: `text` after all pushes and `flush()` equals
    `tokenizer.decode(ids, skip_special_tokens=..., spaces_between_special_tokens=...,
    clean_up_tokenization_spaces=False)` (with `prefix_ids`: that decode of prefix + ids, minus the
    decode of the prefix). Decoding always passes clean_up_tokenization_spaces=False, because the
    clean-up (" ." -> ".") rewrites text across a delta that is already out; transformers 5 skips
    the clean-up for BPE models anyway. Known exceptions, both only for invalid UTF-8:
      * a run of byte-fallback tokens (`<0xE4>`) that is valid UTF-8 up to a push and invalid
        after it: HF turns the *whole* run into U+FFFDs, we keep the characters already out;
      * more than MAX_HELD_TOKENS tokens in a row whose text stays incomplete: the held text is
        forced out (an empty delta's tokens are dropped), so U+FFFDs may be placed differently.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        prefix_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._window = list(prefix_ids)  # context tokens are decoded but never emitted
        self._surr_text = self._decode(self._window)
        if self._surr_text.endswith(REPLACEMENT_CHAR):
            # NOTE: context ending mid-character would shift every later delta; decode without it
            self._window, self._surr_text = [], ""
        self._read = len(self._window)
        self._pieces: list[str] = []
        self._num_tokens = 0
        self._flushed = False

    ##### Public API #####

    def push(self, ids: Sequence[int]) -> str:
        """Add tokens; return the new stable text (may be "")."""
        assert not self._flushed, "push() after flush()"
        if not ids:
            return ""
        self._window.extend(ids)
        self._num_tokens += len(ids)
        new = self._decode(self._window)[len(self._surr_text) :]
        if new and not new.endswith(REPLACEMENT_CHAR):
            return self._emit(new)
        if len(self._window) - self._read > MAX_HELD_TOKENS:
            if new:
                return self._emit(new)
            del self._window[self._read :]  # tokens that add no text (e.g. skipped specials)
        return ""

    def flush(self) -> str:
        """At finish: return whatever is held back, even an incomplete character."""
        if self._flushed:
            return ""
        self._flushed = True
        new = self._decode(self._window)[len(self._surr_text) :]
        self._pieces.append(new)
        return new

    def finish(self, ids: Sequence[int]) -> str:
        """push(ids) then flush(), with one decode (a whole output that arrives at its end: the
        push would decode the window twice more, and the flush once); returns the new text."""
        assert not self._flushed, "finish() after flush()"
        self._window.extend(ids)
        self._num_tokens += len(ids)
        return self.flush()

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the push and flush results)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]  # join lazily: a push stays O(window)
        return self._pieces[0] if self._pieces else ""

    @property
    def num_tokens(self) -> int:
        """Tokens pushed so far (prefix_ids not counted)."""
        return self._num_tokens

    ##### Internal Helper Functions #####

    def _emit(self, new: str) -> str:
        del self._window[: self._read]
        self._read = len(self._window)
        self._surr_text = self._decode(self._window)
        self._pieces.append(new)
        return new

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        text = self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            spaces_between_special_tokens=self._spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str)
        return text

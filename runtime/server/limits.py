"""RequestLimits: the per-request caps the front enforces before any work is queued (top logprobs, n),
and the bound on a text prompt's length that needs no tokenization."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from weft.runtime.server.generate_input import PromptSpec


@dataclass(frozen=True)
class RequestLimits:
    """Caps on what one request may ask for; None is no cap (the offline Engine's default).

    `weft serve` sets them from --max-top-logprobs and --max-n: top logprobs cost a
    (positions x k) table in the reply (k up to the vocabulary, e.g. 49,152 entries per prompt
    token with input logprobs), and each of n samples is a sequence of its own in the batch."""

    max_top_logprobs: int | None = None
    max_n: int | None = None

    def __post_init__(self) -> None:
        if self.max_top_logprobs is not None and self.max_top_logprobs < 0:
            raise ValueError(f"max_top_logprobs must be >= 0, got {self.max_top_logprobs}")
        if self.max_n is not None and self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")

    def check_top_logprobs(self, value: int, name: str) -> None:
        cap = self.max_top_logprobs
        if cap is not None and value > cap:
            raise ValueError(
                f"{name} is {value}, more than this server's limit of {cap} "
                "(set by weft serve --max-top-logprobs)"
            )

    def check_n(self, value: int, name: str = "n") -> None:
        cap = self.max_n
        if cap is not None and value > cap:
            raise ValueError(
                f"{name} is {value}, more than this server's limit of {cap} "
                "(set by weft serve --max-n)"
            )

    def check(self, spec: PromptSpec) -> None:
        """A native request's prompt: its top_logprobs_num and sampling_params.n."""
        self.check_top_logprobs(spec.top_logprobs_num, "top_logprobs_num")
        self.check_n(spec.params.n, "sampling_params.n")


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, where such a bound is sound: a
    byte-level BPE tokenizer without a normalizer (every byte is in its vocabulary, so no run of
    unknown text becomes one token, and a vocabulary string has one character per byte; added
    tokens match their own text). None for any other tokenizer, or none at all.

    A text longer than this times the context length cannot fit, whatever it tokenizes to: it is
    refused without spending seconds of tokenizer time on it (a 10M-character prompt)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (AttributeError, TypeError, ValueError):
        return None
    pre = spec.get("pre_tokenizer") or {}
    parts = [pre, *(pre.get("pretokenizers") or [])]
    byte_level = any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)
    model = spec.get("model") or {}
    if spec.get("normalizer") is not None or model.get("type") != "BPE" or not byte_level:
        return None
    return max((len(s) for s in tokenizer.get_vocab()), default=0) or None


def check_text_fits(text: str, max_chars: int | None, context_len: int) -> None:
    """ValueError if `text` must be longer than the context, from its length alone."""
    if max_chars is None or len(text) <= max_chars * context_len:
        return
    at_least = -(-len(text) // max_chars)
    raise ValueError(
        f"The input (at least {at_least} tokens: {len(text)} characters, at most {max_chars} "
        f"per token) is longer than the model's context length ({context_len} tokens)."
    )

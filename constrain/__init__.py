"""weft.constrain: grammars (JSON schema, regex, EBNF, choices) compiled to token masks."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from weft.constrain.base import CompiledGrammar, GrammarBackend, GrammarMatcher
from weft.constrain.compiler import CompileHandle, GrammarCompiler
from weft.constrain.errors import GrammarError
from weft.constrain.mask import allocate_bitmask, apply_bitmask
from weft.constrain.spec import GrammarSpec
from weft.constrain.vocab import TokenSpace, token_space

BACKENDS = ("llguidance", "outlines")
DEFAULT_BACKEND = "llguidance"  # measured: `benchmarks/host.py grammar`
DEFAULT_JSON_WHITESPACE = 16


def create_grammar_backend(
    name: str,
    tokenizer: Any,
    vocab_size: int,
    stop_ids: Collection[int],
    strict: bool = False,
    max_json_whitespace: int = DEFAULT_JSON_WHITESPACE,
    prefetch_masks: bool = True,
    prefetch_forced: bool = False,
    mask_threads: int | None = None,
) -> GrammarBackend:
    """A backend for one model: `tokenizer` a HF fast tokenizer, `vocab_size` the logit width
    (>= the tokenizer's; padded columns are never allowed), `stop_ids` every stop id (allowed
    exactly where the grammar may end). `strict`: refuse schemas with keywords the backend cannot
    enforce (else enforce the rest and list them in `unenforced`). JSON allows at most
    `max_json_whitespace` whitespace characters in a row (none before or after the value).
    `prefetch_masks` (llguidance): compute each next mask on a background thread as soon as a
    token is accepted, so `fill_bitmask` mostly waits for a finished mask (masks are unchanged);
    `prefetch_forced`: also where the next tokens are forced (pass True when forced tokens are
    sampled through masks, i.e. without jump-forward); `mask_threads`: the threads computing
    them (None: llguidance_prefetch.default_workers()).

    JSON semantics, both backends: object properties come in schema order; strings are raw UTF-8
    (llguidance refuses \\u escapes of printable characters). `additionalProperties` absent or
    true: llguidance allows extra properties after the declared ones (JSON Schema's default);
    outlines refuses such open objects and untyped values, which no regex can hold
    (outlines_schema.py: what it enforces exactly, reports or refuses).
    """
    space = token_space(tokenizer, vocab_size, stop_ids)
    whitespace = rf"[ \t\n\r]{{0,{max_json_whitespace}}}" if max_json_whitespace else ""
    if name == "llguidance":
        from weft.constrain.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(
            space, tokenizer, strict, whitespace, prefetch_masks, prefetch_forced, mask_threads
        )
    if name == "outlines":
        from weft.constrain.outlines_backend import OutlinesBackend

        return OutlinesBackend(space, tokenizer, strict, whitespace)
    raise ValueError(f"unknown grammar backend {name!r} (choose from {', '.join(BACKENDS)})")


__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "CompileHandle",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSpec",
    "TokenSpace",
    "allocate_bitmask",
    "apply_bitmask",
    "create_grammar_backend",
]

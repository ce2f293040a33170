"""llguidance backend: JSON schema, regex, Lark/GBNF and choices via an Earley parser over a lazy lexer."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import torch

from weft.constrain.base import (
    STRICT_NOTE,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
)
from weft.constrain.schema import llguidance_keywords
from weft.constrain.vocab import TokenSpace

# NOTE: llguidance bounds every compile and mask step by fuel, not time (so a compile thread
# always finishes): these are its defaults, spelled out because the compile timeout relies on them.
PARSER_LIMITS: dict[str, Any] = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,  # ~20 ms of regex work at compile time
    "step_lexer_fuel": 200_000,  # ~15 ms per mask at most
    "step_max_items": 50_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
    "verbose_errors": False,
}


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(
        self, space: TokenSpace, tokenizer: Any, strict: bool, json_whitespace: str
    ) -> None:
        super().__init__(space, strict)
        stops = sorted(space.stop_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=space.vocab_size, eos_token=stops
        )
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self._json_options: dict[str, Any] = {"whitespace_pattern": json_whitespace}
        self._json_whitespace = json_whitespace

    @property
    def cache_key(self) -> tuple[object, ...]:
        return (*super().cache_key, self._json_whitespace)

    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> CompiledGrammar:
        grammar = self._grammar_text(spec)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise self._refusal(spec, matcher.get_error())
        unenforced = (
            llguidance_keywords(matcher.get_grammar_warnings())
            if spec.kind == "json_schema"
            else []
        )
        compiled = LLGuidanceGrammar(spec, unenforced, self.space, matcher)
        compiled.warm_up()
        if matcher.is_error():
            raise self._refusal(spec, matcher.get_error())
        return compiled

    def _grammar_text(self, spec: GrammarSpec) -> str:
        make = llguidance.LLMatcher
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.spec if spec.kind == "json_schema" else '{"type":"object"}'
            options = {**self._json_options, "lenient": not self.strict_for(spec)}
            try:
                return make.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
            except ValueError as e:  # e.g. nesting deeper than its JSON parser's recursion limit
                raise GrammarError(f"invalid json_schema: {e}") from None
        if spec.kind == "regex":
            return make.grammar_from_regex(spec.spec)
        if spec.kind == "choices":
            lark = "start: " + " | ".join(json.dumps(c) for c in spec.choice_list())
            return make.grammar_from_lark(lark)
        try:
            return llguidance.grammar_from("ebnf", spec.spec)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise GrammarError(f"invalid ebnf grammar: {e}") from None

    def _refusal(self, spec: GrammarSpec, message: str) -> GrammarError:
        if spec.kind == "json_schema" and (
            "Unimplemented keys" in message or message.startswith(("Unknown format", "oneOf"))
        ):
            keywords = llguidance_keywords([message])
            why = f"unsupported JSON schema keyword(s): {', '.join(keywords)}"
            return GrammarError(why + STRICT_NOTE * (spec.strict and not self.strict), keywords)
        text = message.strip()[:500]
        if "too big" in text or "limit" in text or "fuel" in text:
            return GrammarError(f"{spec.kind} is too complex to compile: {text}")
        return GrammarError(f"invalid {spec.kind}: {text}")


class LLGuidanceGrammar(CompiledGrammar):
    """A pristine matcher that is never advanced; requests get deep copies (sharing its lexer cache)."""

    def __init__(
        self, spec: GrammarSpec, unenforced: list[str], space: TokenSpace, template: Any
    ) -> None:
        super().__init__(spec, unenforced)
        self._space = space
        self._template = template

    def warm_up(self) -> None:
        """Compute the first mask now, so that compile time includes it and requests start warm."""
        scratch = torch.empty((1, self._space.words), dtype=torch.int32)
        self._template.unsafe_compute_mask_ptr(scratch.data_ptr(), self._space.words * 4)

    def matcher(self) -> GrammarMatcher:
        return LLGuidanceMatcher(self._space, self._template.deep_copy())


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, space: TokenSpace, matcher: Any) -> None:
        super().__init__(space)
        self._m = matcher

    def error(self) -> str | None:
        return str(self._m.get_error()) if self._m.is_error() else None

    def _fill_content(self, row_ptr: int) -> None:
        self._m.unsafe_compute_mask_ptr(row_ptr, self._space.words * 4)

    def _can_end(self) -> bool:
        return bool(self._m.is_accepting())

    def _accept_content(self, token: int) -> bool:
        # NOTE: consume_token on a forbidden token poisons the matcher; validate first.
        if self._m.validate_tokens([token]) != 1:
            return False
        ok = self._m.consume_token(token)
        assert ok, self._m.get_error()
        return True

    def _rollback_content(self, k: int) -> None:
        ok = self._m.rollback(k)
        assert ok, f"rollback({k}) failed: {self._m.get_error()}"

    def _forced_content(self) -> list[int]:
        return list(self._m.compute_ff_tokens())

    def _clone(self) -> GrammarMatcher:
        return LLGuidanceMatcher(self._space, self._m.deep_copy())

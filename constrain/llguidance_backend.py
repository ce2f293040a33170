"""llguidance backend: JSON schema, regex, Lark/GBNF and choices via an Earley parser over a lazy lexer
(compiling and repairing specs; a request's matcher and its mask prefetch: llguidance_matcher)."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import llguidance
import llguidance.hf
import torch

from weft.constrain.base import CompiledGrammar, GrammarBackend, GrammarMatcher
from weft.constrain.errors import STRICT_NOTE, GrammarError
from weft.constrain.formats import INEXACT_FORMATS, format_patterns
from weft.constrain.llguidance_matcher import LLGuidanceMatcher
from weft.constrain.llguidance_prefetch import MaskWorker
from weft.constrain.regex_text import ascii_classes, lark_ascii_classes
from weft.constrain.schema import (
    llguidance_keywords,
    string_patterns,
    without_patterns,
    without_remote_refs,
)
from weft.constrain.schema_paths import integral_counts, located
from weft.constrain.schema_refs import merged_sibling_refs
from weft.constrain.schema_rewrites import exact_rewrites
from weft.constrain.spec import GrammarSpec
from weft.constrain.structural_format import format_grammar, format_texts
from weft.constrain.structural_tag import structural_tag_format
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
MAX_REPAIRS = 8  # compile rounds that each drop what one library error was about
_REMOTE = re.compile(r"Resource '([^']*)' is not present in a registry")
_Repair = tuple[dict[str, Any], list[str]]  # a repaired schema, the keywords it no longer enforces


def remote_ref_refusal(uri: str) -> str:
    return (
        f"remote $ref {uri!r} is not supported: weft does not fetch referenced documents; "
        "put the referenced schema under $defs"
    )


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"
    # weft's rewrites of valid schemas the library misreads (schema_paths.integral_counts); off
    # only to measure the library alone (constrain/conformance.py's llguidance-strict)
    rewrites = True

    def __init__(
        self,
        space: TokenSpace,
        tokenizer: Any,
        strict: bool,
        json_whitespace: str,
        prefetch_masks: bool = True,
        prefetch_forced: bool = False,
        mask_threads: int | None = None,
    ) -> None:
        super().__init__(space, strict)
        worker = MaskWorker(mask_threads) if prefetch_masks else None
        self._prefetch = (worker, prefetch_forced)
        stops = sorted(space.stop_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=space.vocab_size, eos_token=stops
        )
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self._json_options: dict[str, Any] = {"whitespace_pattern": json_whitespace}
        self._json_whitespace = json_whitespace
        # the texts of special / added tokens, which structural tags write as the token itself
        never = sorted(i for i in space.special_ids | space.stop_ids if i < space.tokenizer_size)
        text_of = {i: str(tokenizer.convert_ids_to_tokens(i)) for i in never}
        self._stop_texts = {text_of[i] for i in space.stop_ids if i in text_of}
        self._token_ids = {t: i for i, t in text_of.items() if i in space.special_ids and t}

    @property
    def cache_key(self) -> tuple[object, ...]:
        return (*super().cache_key, self._json_whitespace)

    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> CompiledGrammar:
        rewritten, inexact = self._rewritten(spec, exact=True)
        try:
            return self._compiled(spec, rewritten, inexact)
        except GrammarError:
            # NOTE: an exact rewrite the library cannot compile: the schema as written decides
            plain, inexact = self._rewritten(spec, exact=False)
            if plain.spec == rewritten.spec:
                raise
        return self._compiled(spec, plain, inexact)

    def _compiled(
        self, spec: GrammarSpec, rewritten: GrammarSpec, inexact: list[str]
    ) -> CompiledGrammar:
        """`spec` compiled as `rewritten` (its schema after weft's rewrites)."""
        matcher, dropped, structure_ids = self._repaired_matcher(rewritten)
        unenforced = (
            inexact + dropped + llguidance_keywords(matcher.get_grammar_warnings())
            if spec.kind in ("json_schema", "structural_tag")
            else []
        )
        space = self.space.allowing(structure_ids)
        compiled = LLGuidanceGrammar(spec, unenforced, space, matcher, *self._prefetch)
        compiled.warm_up()
        if matcher.is_error():
            raise self._refusal(spec, matcher.get_error())
        return compiled

    def _rewritten(self, spec: GrammarSpec, exact: bool) -> tuple[GrammarSpec, list[str]]:
        """(`spec` with weft's rewrites applied (itself if none applies), the formats its
        grammar enforces only in part: refused if strict). Recursive `$ref`s with siblings become
        merged definitions (schema_refs.py), keywords the library does not enforce become ones it
        does where that is exact (schema_rewrites.py; if `exact`), formats become patterns
        (formats.py); patterns read `\\d` `\\w` `\\s` as ASCII (the library reads `\\s` as
        Unicode's spaces) and negated classes keep a quote out (schema.string_patterns)."""
        if spec.kind != "json_schema" or not self.rewrites:
            return spec, []
        schema = json.loads(spec.spec)
        fixed = merged_sibling_refs(integral_counts(schema))
        fixed, inexact = format_patterns(exact_rewrites(fixed) if exact else fixed)
        fixed = string_patterns(fixed)
        if inexact and self.strict_for(spec):
            why = ", ".join(f"{k} ({INEXACT_FORMATS[k[len('format:') :]]})" for k in inexact)
            where = located(schema, inexact).partition(" ")[2]
            raise GrammarError(
                f"unsupported JSON schema keyword(s): {why} {where}".rstrip()
                + self._strict_note(spec),
                inexact,
            )
        if fixed is schema:
            return spec, inexact
        return GrammarSpec.json_schema(fixed, spec.strict), inexact

    def _matcher(self, spec: GrammarSpec) -> tuple[Any, frozenset[int]]:
        """A matcher for `spec`, and the structure tokens its grammar writes (structural tags)."""
        grammar, ids = self._grammar_text(spec)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        return matcher, ids

    ##### Repairs: what the library cannot compile, dropped and reported (refused if strict) #####

    def _repaired_matcher(self, spec: GrammarSpec) -> tuple[Any, list[str], frozenset[int]]:
        """(a matcher for `spec`, or for `spec` less what the library failed on, the keywords so
        dropped, its structure tokens). Each round drops what the library's error is about and
        compiles again; an error that no repair removes anything for refuses the spec with the
        library's reason."""
        matcher, ids = self._matcher(spec)
        dropped: list[str] = []
        patterns: dict[str, str] = {}  # pattern -> the library's error about it ("" if none)
        repairs = (
            self._drop_unknown_dialect,
            self._drop_remote_refs,
            functools.partial(self._drop_bad_patterns, cache=patterns),
        )
        current = spec
        for _ in range(MAX_REPAIRS):
            if spec.kind != "json_schema" or not matcher.is_error():
                break
            schema, error = json.loads(current.spec), matcher.get_error()
            repaired = next(filter(None, (repair(spec, schema, error) for repair in repairs)), None)
            if repaired is None:
                break
            current = GrammarSpec.json_schema(repaired[0], spec.strict)
            matcher, dropped = self._matcher(current)[0], dropped + repaired[1]
        if matcher.is_error():
            raise self._refusal(spec, matcher.get_error())
        return matcher, list(dict.fromkeys(dropped)), ids

    # Each repair: (`schema` without what `error` is about, the keywords so dropped), or None where
    # it does not apply or removes nothing; where it applies to a strict spec, a GrammarError.

    def _drop_unknown_dialect(self, spec: GrammarSpec, schema: Any, error: str) -> _Repair | None:
        """A `$schema` URI the library failed to resolve: a dialect it does not know (e.g.
        SchemaStore's stricter draft-07 meta-schema). It only validates schemas, yet instances
        are then read under the default dialect, so `$schema` is reported as not enforced."""
        uri = schema.get("$schema") if isinstance(schema, dict) else None
        if not isinstance(uri, str) or f"Resource '{uri}'" not in error:
            return None
        if self.strict_for(spec):
            why = f"unknown JSON Schema dialect ($schema {uri!r} at #/$schema)"
            raise GrammarError(why + self._strict_note(spec), ["$schema"])
        return {k: v for k, v in schema.items() if k != "$schema"}, ["$schema"]

    def _drop_remote_refs(self, spec: GrammarSpec, schema: Any, error: str) -> _Repair | None:
        """`$ref`s into a document the library does not have (weft never fetches one)."""
        remote = _REMOTE.search(error)
        if remote is None or not isinstance(schema, dict):
            return None
        uri = remote.group(1)
        plain, removed = without_remote_refs(schema, uri)
        if not removed:  # NOTE: a $ref where the walker does not look: refused, never a loop
            return None
        if self.strict_for(spec):
            where = located(schema, [f"$ref:{uri}"]).partition(" ")[2]
            why = remote_ref_refusal(uri) + (f" {where}" if where else "")
            raise GrammarError(why + self._strict_note(spec), [f"$ref:{uri}"])
        return plain, [f"$ref:{uri}"]

    def _drop_bad_patterns(
        self, spec: GrammarSpec, schema: Any, error: str, cache: dict[str, str]
    ) -> _Repair | None:
        """String `pattern`s that the library's regex engine cannot compile (lookarounds, `\\b`)."""
        if "regex" not in error or not isinstance(schema, dict):
            return None
        plain, bad = without_patterns(schema, lambda p: not self._pattern_error(p, cache))
        if not bad:
            return None
        if self.strict_for(spec):
            why = f"unsupported JSON schema keyword(s): pattern ({bad[0]!r}: "
            why += f"{self._pattern_error(bad[0], cache)})"
            raise GrammarError(why + self._strict_note(spec), ["pattern"])
        return plain, ["pattern"]

    def _strict_note(self, spec: GrammarSpec) -> str:
        """STRICT_NOTE where only the request's own strict flag refuses the spec."""
        return STRICT_NOTE * (spec.strict and not self.strict)

    def _pattern_error(self, pattern: str, cache: dict[str, str]) -> str:
        """Why the library cannot compile `pattern` as a JSON string's pattern ("" if it can)."""
        if pattern not in cache:
            schema = json.dumps({"type": "string", "pattern": pattern})
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
            error = llguidance.LLMatcher.validate_grammar(grammar, limits=self._limits)
            cache[pattern] = " ".join(error.split())[:300]
        return cache[pattern]

    def _grammar_text(self, spec: GrammarSpec) -> tuple[str, frozenset[int]]:
        if spec.kind == "structural_tag":
            return self._structural_tag_grammar(spec)
        return self._plain_grammar_text(spec), frozenset()

    def _plain_grammar_text(self, spec: GrammarSpec) -> str:
        make = llguidance.LLMatcher
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.spec if spec.kind == "json_schema" else '{"type":"object"}'
            options = {**self._json_options, "lenient": not self.strict_for(spec)}
            try:
                return make.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
            except ValueError as e:  # e.g. nesting deeper than its JSON parser's recursion limit
                raise GrammarError(f"invalid json_schema: {e}") from None
        if spec.kind == "regex":
            return make.grammar_from_regex(ascii_classes(spec.spec))
        if spec.kind == "choices":
            lark = "start: " + " | ".join(json.dumps(c) for c in spec.choice_list())
            return make.grammar_from_lark(lark)
        try:
            lark = llguidance.grammar_from("ebnf", spec.spec)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise GrammarError(f"invalid ebnf grammar: {e}") from None
        return lark_ascii_classes(lark)

    def _structural_tag_grammar(self, spec: GrammarSpec) -> tuple[str, frozenset[int]]:
        """The grammar and its structure tokens (special / added tokens its tags hold)."""
        tree = structural_tag_format(spec.spec)
        for text in format_texts(tree):
            for stop in self._stop_texts:
                if stop in text:
                    raise GrammarError(
                        f"structural_tag text {text!r} holds {stop!r}, a stop token of the "
                        "model: it would end the output"
                    )
        options = {**self._json_options, "lenient": not self.strict_for(spec)}
        grammar, ids = format_grammar(tree, options, self._token_ids)
        if not grammar.startswith("{"):
            grammar = llguidance.LLMatcher.grammar_from_lark(grammar)
        return grammar, ids

    def _refusal(self, spec: GrammarSpec, message: str) -> GrammarError:
        if spec.kind in ("json_schema", "structural_tag") and (
            "Unimplemented keys" in message or message.startswith(("Unknown format", "oneOf"))
        ):
            keywords = llguidance_keywords([message])
            why = f"unsupported JSON schema keyword(s): {located(_schema_of(spec), keywords)}"
            return GrammarError(why + self._strict_note(spec), keywords)
        text = message.strip()[:500]
        remote = _REMOTE.search(text)
        if remote:
            return GrammarError(remote_ref_refusal(remote.group(1)))
        if "too big" in text or "limit" in text or "fuel" in text:
            return GrammarError(f"{spec.kind} is too complex to compile: {text}")
        return GrammarError(f"invalid {spec.kind}: {text}")


def _schema_of(spec: GrammarSpec) -> Any:
    """The schema a json_schema spec holds (None for other kinds: nothing to locate)."""
    return json.loads(spec.spec) if spec.kind == "json_schema" else None


class LLGuidanceGrammar(CompiledGrammar):
    """A pristine matcher that is never advanced; requests get deep copies (sharing its lexer cache)."""

    def __init__(
        self,
        spec: GrammarSpec,
        unenforced: list[str],
        space: TokenSpace,
        template: Any,
        worker: MaskWorker | None = None,
        prefetch_forced: bool = False,
    ) -> None:
        super().__init__(spec, unenforced)
        self._space = space
        self._template = template
        self._prefetch = (worker, prefetch_forced)

    def warm_up(self) -> None:
        """Compute the first mask now, so that compile time includes it and requests start warm."""
        scratch = torch.empty((1, self._space.words), dtype=torch.int32)
        self._template.unsafe_compute_mask_ptr(scratch.data_ptr(), self._space.words * 4)

    def matcher(self) -> GrammarMatcher:
        return LLGuidanceMatcher(self._space, self._template.deep_copy(), *self._prefetch)

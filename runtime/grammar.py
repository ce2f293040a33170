"""GrammarQueue: constrained requests wait here while their grammar compiles off the scheduler loop."""

from __future__ import annotations

import json
import logging
from typing import Any

from weft.constrain import (
    GrammarBackend,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    create_grammar_backend,
)
from weft.runtime.config import EngineConfig
from weft.runtime.request import Req
from weft.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    """The request's constraint, if any (SamplingParams already allows at most one)."""
    if params.json_schema is not None:
        try:
            schema = json.loads(params.json_schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        if schema == {"type": "object"}:  # OpenAI's json_object mode
            return GrammarSpec.json_object()
        return GrammarSpec.json_schema(schema, strict=params.strict_json_schema)
    if params.regex is not None:
        return GrammarSpec.regex(params.regex)
    if params.ebnf is not None:
        return GrammarSpec.ebnf(params.ebnf)
    return None


class GrammarQueue:
    """Compiles in the background (GrammarCompiler: timeout, LRU cache incl. failures); the backend
    (vocabulary tables, ~1 s) is built on the first constrained request."""

    def __init__(
        self, config: EngineConfig, tokenizer: Any, vocab_size: int, stop_ids: frozenset[int]
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.compiler: GrammarCompiler | None = None
        self.pending: list[Req] = []

    def _compiler(self) -> GrammarCompiler:
        if self.compiler is None:
            backend: GrammarBackend = create_grammar_backend(
                self.config.grammar_backend,
                self.tokenizer,
                self.vocab_size,
                self.stop_ids,
                strict=self.config.strict_schemas,
            )
            self.compiler = GrammarCompiler(backend, timeout_s=self.config.grammar_timeout)
        return self.compiler

    def submit(self, req: Req, spec: GrammarSpec) -> None:
        req.grammar_handle = self._compiler().submit(spec)
        self.pending.append(req)

    def poll(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """Requests whose grammar is ready (matcher attached) and those whose compile failed."""
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        still: list[Req] = []
        for req in self.pending:
            handle = req.grammar_handle
            if not handle.done():
                still.append(req)
                continue
            try:
                grammar = handle.result()
            except GrammarError as e:
                failed.append((req, f"Failed to compile the grammar: {e}"))
                continue
            req.grammar = grammar.matcher()
            req.unenforced = list(grammar.unenforced)
            req.grammar_handle = None
            ready.append(req)
        self.pending = still
        return ready, failed

    def remove(self, rids: set[str] | None) -> list[Req]:
        """Drop pending requests (all when rids is None); returns them."""
        out = [r for r in self.pending if rids is None or r.rid in rids]
        self.pending = [r for r in self.pending if r not in out]
        return out

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()

"""GrammarQueue: constrained requests wait here while their grammar compiles off the scheduler loop;
a thinking budget wraps a request's matcher (or is its only one)."""

from __future__ import annotations

import json
import logging
from typing import Any

from weft.constrain import (
    GrammarBackend,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    create_grammar_backend,
)
from weft.constrain.errors import PROCESS_EXITS, failure_text
from weft.constrain.limits import DEFAULT_LIMITS
from weft.constrain.reasoning import reasoning_format
from weft.constrain.thinking_budget import ThinkingBudget
from weft.runtime.config import EngineConfig
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.request import Req

logger = logging.getLogger(__name__)


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    """The request's constraint, if any (SamplingParams already allows at most one)."""
    if params.json_schema is not None:
        DEFAULT_LIMITS.check_json_depth(params.json_schema, "json_schema")
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
    if params.structural_tag is not None:
        return GrammarSpec.structural_tag(params.structural_tag, strict=params.strict_json_schema)
    return None


class GrammarQueue:
    """Compiles in the background (GrammarCompiler: timeout, LRU cache incl. failures); the backend
    (vocabulary tables, ~1 s) is built by `start_backend` (the scheduler calls it at start-up on
    GPUs) or else on the first constrained request."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: frozenset[int],
        timeout_s: float | None = None,
    ) -> None:
        self.config = config
        self.timeout_s = config.grammar_timeout if timeout_s is None else timeout_s
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.compiler: GrammarCompiler | None = None
        self.broken: str | None = None  # why the backend could not be built
        self.pending: list[Req] = []
        self._markers: tuple[tuple[int, ...], tuple[int, ...], bool] | None = None

    def _compiler(self) -> GrammarCompiler:
        """The compiler, built on first use. A backend that cannot start (a broken install, an
        incompatible tokenizer) is a GrammarError for every constrained request, never a crash."""
        if self.compiler is None:
            if self.broken is not None:
                raise GrammarError(self.broken)
            try:
                backend: GrammarBackend = create_grammar_backend(
                    self.config.grammar_backend,
                    self.tokenizer,
                    self.vocab_size,
                    self.stop_ids,
                    strict=(
                        self.config.grammar_strictness == "strict" or self.config.strict_schemas
                    ),
                    # NOTE: forced tokens are sampled through masks unless jump-forward runs
                    # (the scheduler's rule), so their masks are prefetched too
                    prefetch_forced=(
                        self.config.disable_jump_forward or self.config.resolved_overlap
                    ),
                    mask_threads=self.config.tuning.grammar_mask_threads,
                )
            except Exception as e:
                logger.warning(
                    "the %s grammar backend failed to start (%s: %s); constrained requests "
                    "will be refused with this reason",
                    self.config.grammar_backend,
                    type(e).__name__,
                    e,
                )
                self.broken = (
                    f"constrained decoding is unavailable: the {self.config.grammar_backend} "
                    f"backend failed to start ({type(e).__name__}: {e})"
                )
                raise GrammarError(self.broken) from e
            self.compiler = GrammarCompiler(
                backend, timeout_s=self.timeout_s, limits=self.config.grammar_limits
            )
        return self.compiler

    def start_backend(self) -> None:
        """Build the backend now (at start-up) instead of on the first constrained request,
        whose ~1 s build would otherwise stall every running request once. A backend that
        cannot start is remembered and refuses constrained requests with the reason."""
        try:
            self._compiler()
        except GrammarError:
            pass  # logged; every constrained request gets the reason

    def submit(self, req: Req, spec: GrammarSpec) -> None:
        req.grammar_handle = self._compiler().submit(spec)
        self.pending.append(req)

    def scan(self) -> tuple[list[int], list[tuple[int, str]]]:
        """Positions in `pending` of finished compiles: ready ones, and failed ones with the reason.
        Changes nothing (tensor parallelism: rank 0 scans, every rank takes the same positions)."""
        ready: list[int] = []
        failed: list[tuple[int, str]] = []
        for i, req in enumerate(self.pending):
            handle = req.grammar_handle
            if not handle.done():
                continue
            try:
                handle.result()
            except GrammarError as e:
                failed.append((i, f"Failed to compile the grammar: {e}"))
                continue
            ready.append(i)
        return ready, failed

    def take(
        self, ready: list[int], failed: list[tuple[int, str]]
    ) -> tuple[list[Req], list[tuple[Req, str]]]:
        """Remove the scanned positions from `pending`: ready requests get their matcher (waiting
        for a compile still running here, as on a follower rank), failed ones come with the reason."""
        out_ready: list[Req] = []
        out_failed = [(self.pending[i], reason) for i, reason in failed]
        for i in ready:
            req = self.pending[i]
            try:
                grammar = req.grammar_handle.result()
            except GrammarError as e:
                raise RuntimeError(
                    f"grammar compiled on rank 0 but failed here ({e}); tensor-parallel ranks "
                    "must agree, raise grammar_timeout"
                ) from e
            req.grammar_handle = None
            try:
                req.grammar = self.with_budget(req, grammar.matcher())
            except PROCESS_EXITS:
                raise
            except BaseException as e:  # the backend failed starting it: this request alone
                logger.warning("a %s matcher failed to start", grammar.spec.kind, exc_info=e)
                why = f"Failed to start the grammar: {failure_text(e)}"
                out_failed.append((req, why))
                continue
            req.unenforced = list(grammar.unenforced)
            out_ready.append(req)
        gone = set(ready) | {i for i, _ in failed}
        self.pending = [r for i, r in enumerate(self.pending) if i not in gone]
        return out_ready, out_failed

    def markers(self) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        """(start ids, end ids, starts inside) of the reasoning parser's think markers; a
        GrammarError where no reasoning parser is set or no tokenizer is loaded."""
        if self._markers is None:
            name = self.config.reasoning_parser
            if name is None:
                raise GrammarError("thinking_budget needs a reasoning model's markers: start the "
                                   "server with --reasoning-parser")  # fmt: skip
            if self.tokenizer is None:
                raise GrammarError("thinking_budget needs the tokenizer (skip_tokenizer_init)")
            fmt = reasoning_format(name)
            start, end = (tuple(self.tokenizer.encode(m, add_special_tokens=False))
                          for m in (fmt.start, fmt.end))  # fmt: skip
            self._markers = (start, end, fmt.starts_inside)
        return self._markers

    def with_budget(self, req: Req, inner: GrammarMatcher | None) -> GrammarMatcher:
        """The request's matcher under its thinking_budget (`inner` itself without one)."""
        budget = req.params.thinking_budget
        if budget is None:
            assert inner is not None
            return inner
        start, end, inside = self.markers()
        return ThinkingBudget(self._compiler().backend.space, inner, budget, start, end, inside)

    def remove(self, rids: set[str] | None) -> list[Req]:
        """Drop pending requests (all when rids is None); returns them."""
        out = [r for r in self.pending if rids is None or r.rid in rids]
        self.pending = [r for r in self.pending if r not in out]
        return out

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()

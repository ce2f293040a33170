"""The grammar layer's interface: compiled grammars, per-request matchers and backends."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from weft.constrain.errors import PROCESS_EXITS, GrammarError, failure_text
from weft.constrain.spec import GrammarSpec
from weft.constrain.vocab import TokenSpace

logger = logging.getLogger(__name__)


class CompiledGrammar(ABC):
    """A spec compiled against one tokenizer: immutable and shared by every request that uses it.

    `unenforced` lists the schema keywords that this backend accepted but does not enforce
    (never silently: the server reports them); it is empty under `strict`.
    """

    def __init__(self, spec: GrammarSpec, unenforced: Sequence[str] = ()) -> None:
        self.spec = spec
        self.unenforced = tuple(unenforced)

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""

    def require_enforced(self) -> None:
        """Per-request strict mode (OpenAI `strict: true`): refuse if anything is unenforced."""
        if self.unenforced:
            names = ", ".join(self.unenforced)
            raise GrammarError(f"unsupported JSON schema keyword(s): {names}", self.unenforced)


class GrammarMatcher(ABC):
    """Per-request grammar state (one per request, fork branch and n>1 copy).

    Stop ids are handled here, the same for every backend: they are allowed exactly where the
    grammar may end; accepting one terminates the matcher, after which only stop ids are allowed.
    Special/added tokens and padded vocab columns are never allowed. Subclasses implement the
    `_content` hooks for ordinary tokens only.

    A hook that raises (a library assert, a Rust panic, a bug) fails this matcher alone: it then
    reports `error()`, allows only stop ids and accepts nothing, so its request ends with the
    error while the rest of the batch goes on. Only the interpreter's exits propagate.
    """

    def __init__(self, space: TokenSpace) -> None:
        self._space = space
        self._stops = 0  # NOTE: stop tokens accepted; they can only sit at the tail of the history
        self._buffer: torch.Tensor | None = None  # the bitmask last checked (one per run, reused)
        self._failure: str | None = None  # why a hook raised; the matcher is done

    ##### Public API #####

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, bind: bool = False) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 [B, ceil(V/32)], CPU, 1 = allowed).

        `bind`: the row stays this matcher's until `release()` (the runtime: the request's slot),
        and the caller neither writes it nor reads it while a token is being accepted; a backend
        may then write the next masks into it ahead of their fill (llguidance's prefetch), which
        is then only a wait. Without `bind`, nothing writes the row after this returns.
        """
        try:
            self._fill(bitmask, row, bind)
        except PROCESS_EXITS:
            raise
        except BaseException as e:
            self._fail("computing the mask", e)
            self._space.allow_only_stops(self._row_ptr(bitmask, row))

    def _fill(self, bitmask: torch.Tensor, row: int, bind: bool) -> None:
        """fill_bitmask's work (a backend may override it to use `bind`)."""
        row_ptr = self._row_ptr(bitmask, row)
        if self._stops or self.error() is not None:
            self._space.allow_only_stops(row_ptr)
            return
        if self._fill_final(row_ptr):
            return
        self._fill_content(row_ptr)
        self._space.mask_non_content(row_ptr)
        if self._can_end():
            self._space.allow_stops(row_ptr)

    def _row_ptr(self, bitmask: torch.Tensor, row: int) -> int:
        """The address of `bitmask[row]`, the bitmask's type and layout checked."""
        space = self._space
        if bitmask is not self._buffer:  # NOTE: type and layout checked once per buffer (~1 us)
            assert bitmask.dtype == torch.int32 and not bitmask.is_cuda
            assert bitmask.shape[1] == space.words and bitmask.is_contiguous()
            self._buffer = bitmask
        assert 0 <= row < bitmask.shape[0]
        return bitmask.data_ptr() + 4 * space.words * row

    def accept_token(self, token: int) -> bool:
        """Advance by one sampled token; False (and no state change) if the grammar forbids it.

        Every token the mask allows is accepted. The converse may not hold: llguidance's mask
        keeps only the canonical tokenization of forced text, yet any tokenization is accepted.
        A matcher in error accepts nothing.
        """
        if self._failure is not None:
            return False
        try:
            return self._accept(token)
        except PROCESS_EXITS:
            raise
        except BaseException as e:
            self._fail(f"accepting token {token}", e)
            return False

    def _accept(self, token: int) -> bool:
        space = self._space
        if token in space.stop_ids:
            if self._stops or self._can_end():
                self._stops += 1
                return True
            return False
        if self._stops or not space.is_content(token):
            return False
        return self._accept_content(token)

    def rollback(self, k: int) -> None:
        """Undo the last `k` accepted tokens (retraction, speculative rejection)."""
        assert k >= 0
        if self._failure is not None:
            return
        undo_stops = min(k, self._stops)
        self._stops -= undo_stops
        if k - undo_stops:
            try:
                self._rollback_content(k - undo_stops)
            except PROCESS_EXITS:
                raise
            except BaseException as e:
                self._fail(f"rolling back {k} tokens", e)

    def release(self) -> None:  # noqa: B027 - optional hook: most matchers write no row later
        """The row of the last `fill_bitmask(..., bind=True)` is no longer this matcher's (its
        request slot was freed): once this returns, nothing writes it on the matcher's behalf.
        Call it before the row is handed on."""

    def is_terminated(self) -> bool:
        """True once a stop token was accepted."""
        return self._stops > 0

    def forced_tokens(self) -> list[int]:
        """Jump-forward: the tokens that are the only allowed continuation now, in order ([] if none).

        Token-exact: each returned token is the only bit its step's mask would allow, so feeding
        them without sampling gives the same output as sampling them one by one. Never a stop id.
        """
        if self._stops or self.error() is not None:
            return []
        try:
            content = self._forced_content()
        except PROCESS_EXITS:
            raise
        except BaseException as e:
            self._fail("computing forced tokens", e)
            return []
        forced: list[int] = []
        for token in content:
            if not self._space.is_content(token):
                break
            forced.append(token)
        return forced

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (fork, n>1); a GrammarError if the backend
        cannot copy it (or it is in error)."""
        if self._failure is not None:
            raise GrammarError(f"the grammar failed: {self._failure}")
        try:
            clone = self._clone()
        except PROCESS_EXITS:
            raise
        except BaseException as e:
            raise GrammarError(f"the grammar failed copying its state: {failure_text(e)}") from e
        clone._stops = self._stops
        return clone

    def error(self) -> str | None:
        """Why the grammar cannot go on (a backend limit hit mid-generation, or a backend call
        that raised), else None. A matcher in error allows only stop ids, so the request ends;
        report it as an error."""
        if self._failure is not None:
            return self._failure
        try:
            return self._library_error()
        except PROCESS_EXITS:
            raise
        except BaseException as e:
            self._fail("reading its state", e)
            return self._failure

    def _fail(self, doing: str, e: BaseException) -> None:
        """A hook raised: the matcher is done (logged with the traceback; the request reports it)."""
        self._failure = f"the grammar backend failed {doing} ({failure_text(e)})"
        logger.warning("%s", self._failure, exc_info=e)

    ##### Backend hooks (ordinary tokens only) #####

    def _library_error(self) -> str | None:
        """The library's own error state (e.g. a fuel limit hit), if any."""
        return None

    def _fill_final(self, row_ptr: int) -> bool:
        """Write the whole row (stops and non-content handled, as below) if the backend already
        has it, e.g. prefetched; False: the row is built from the hooks below."""
        return False

    @abstractmethod
    def _fill_content(self, row_ptr: int) -> None:
        """Write the library's mask into the row at `row_ptr` (int32 [words]; stop and special
        bits are fixed up afterwards)."""

    @abstractmethod
    def _can_end(self) -> bool:
        """Whether the text so far is a complete match."""

    @abstractmethod
    def _accept_content(self, token: int) -> bool:
        """Advance by an ordinary token; False with the state unchanged if it is not allowed."""

    @abstractmethod
    def _rollback_content(self, k: int) -> None:
        """Undo the last `k` ordinary tokens."""

    @abstractmethod
    def _forced_content(self) -> list[int]:
        """The token-exact forced continuation (may be [])."""

    @abstractmethod
    def _clone(self) -> GrammarMatcher:
        """A copy of the library state (the base class copies the stop count)."""


class GrammarBackend(ABC):
    """Compiles specs against one tokenizer. Created by `create_grammar_backend(name, ...)`."""

    name: str

    def __init__(self, space: TokenSpace, strict: bool) -> None:
        self.space = space
        self.strict = strict

    @property
    def cache_key(self) -> tuple[object, ...]:
        """Everything besides the spec that changes what `compile` returns."""
        return (self.name, self.space.fingerprint, self.strict)

    def strict_for(self, spec: GrammarSpec) -> bool:
        """Whether unenforceable keywords refuse this spec (the backend's or the spec's strict)."""
        return self.strict or spec.strict

    @abstractmethod
    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> CompiledGrammar:
        """Compile `spec`; raises GrammarError (unsupported, invalid, too complex, timed out).

        `timeout_s` bounds the work where the backend can stop it (outlines: a killed worker
        process); llguidance's work is bounded by its own fuel limits instead.
        """

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing to release
        """Release worker processes, if any."""

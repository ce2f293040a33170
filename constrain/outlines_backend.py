"""outlines-core backend: JSON schema (rewritten: outlines_schema.py) -> regex -> token `Index`."""

from __future__ import annotations

import json
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from typing import Any

import outlines_core

import weft.constrain._outlines_worker as worker
from weft.constrain.base import CompiledGrammar, GrammarBackend, GrammarMatcher
from weft.constrain.errors import STRICT_NOTE, GrammarError
from weft.constrain.outlines_containers import ANY_VALUE
from weft.constrain.outlines_schema import outlines_schema
from weft.constrain.regex_text import ascii_classes
from weft.constrain.spec import GrammarSpec
from weft.constrain.vocab import TokenSpace, token_bytes_table

MAX_ROLLBACK = 1 << 20
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(
        self,
        space: TokenSpace,
        tokenizer: Any,
        strict: bool,
        json_whitespace: str,
        workers: int = 2,
    ) -> None:
        super().__init__(space, strict)
        by_bytes: dict[bytes, list[int]] = {}
        for token, data in enumerate(token_bytes_table(tokenizer)):
            # NOTE: byte 0xF4 only starts U+100000..U+10FFFF (private use); dropping the tokens
            # holding it leaves the sentinel U+10FFFF to the sentinel token alone.
            if data and space.is_content(token) and 0xF4 not in data:
                by_bytes.setdefault(data, []).append(token)
        self.sentinel = _sentinel_id(space)
        by_bytes[worker.SENTINEL.encode()] = [self.sentinel]
        self._vocabulary = outlines_core.Vocabulary(min(space.stop_ids), by_bytes)
        self._json_whitespace = json_whitespace
        self._pool = _WorkerPool(self._vocabulary, workers)

    @property
    def cache_key(self) -> tuple[object, ...]:
        return (*super().cache_key, self._json_whitespace)

    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> CompiledGrammar:
        kind, text, unenforced = self._to_job(spec)
        if timeout_s is None:
            try:
                index = worker.build_index(kind, text, self._json_whitespace, self._vocabulary)
            except ValueError as e:
                raise GrammarError(f"outlines cannot compile this {spec.kind}: {e}") from None
        else:
            index = self._pool.build((kind, text, self._json_whitespace), timeout_s, spec.kind)
        return OutlinesGrammar(spec, unenforced, self.space, index, self.sentinel)

    def close(self) -> None:
        self._pool.close()

    def _to_job(self, spec: GrammarSpec) -> tuple[str, str, list[str]]:
        if spec.kind == "json_schema":
            rewritten = outlines_schema(json.loads(spec.spec))
            unenforced = list(rewritten.unenforced)
            if unenforced and self.strict_for(spec):
                why = f"unsupported JSON schema keyword(s) for outlines: {rewritten.located()}"
                raise GrammarError(
                    why + STRICT_NOTE * (spec.strict and not self.strict), unenforced
                )
            return "schema", json.dumps(rewritten.schema), unenforced
        if spec.kind == "json_object":
            raise GrammarError(ANY_VALUE.format("object", ""))
        if spec.kind == "regex":
            return "regex", ascii_classes(spec.spec), []
        if spec.kind == "choices":
            return "regex", "(" + "|".join(map(_escape, spec.choice_list())) + ")", []
        what = "ebnf grammars" if spec.kind == "ebnf" else spec.kind
        raise GrammarError(f"the outlines backend does not support {what} (use llguidance)")


def _sentinel_id(space: TokenSpace) -> int:
    """A token id that is never content (masked anyway) to stand for the end-of-match sentinel."""
    if space.special_ids:
        return min(space.special_ids)
    if space.tokenizer_size < space.vocab_size:
        return space.tokenizer_size
    raise ValueError("the outlines backend needs a special (non-stop) token id or a padded vocab")


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


class OutlinesGrammar(CompiledGrammar):
    def __init__(
        self, spec: GrammarSpec, unenforced: list[str], space: TokenSpace, index: Any, sentinel: int
    ) -> None:
        super().__init__(spec, unenforced)
        self.space = space
        self.index = index
        self.sentinel = sentinel
        self._forced: dict[int, list[int]] = {}  # state -> forced tokens, filled lazily

    def matcher(self) -> GrammarMatcher:
        return OutlinesMatcher(self, outlines_core.Guide(self.index, max_rollback=MAX_ROLLBACK), [])

    def can_end(self, state: int) -> bool:
        # NOTE: the sentinel may also be content (a JSON string can hold U+10FFFF): only a step
        # to a final state means "the match may end here".
        after = self.index.get_next_state(state, self.sentinel)
        return after is not None and bool(self.index.is_final_state(after))

    def forced_from(self, state: int) -> list[int]:
        """Tokens forced from `state`: while one token is allowed and the match may not end yet."""
        cached = self._forced.get(state)
        if cached is None:
            start, cached, seen = state, [], {state}
            while not self.can_end(state):
                allowed = self.index.get_allowed_tokens(state) or []
                if len(allowed) != 1 or allowed[0] == self.sentinel:
                    break
                cached.append(allowed[0])
                state = self.index.get_next_state(state, allowed[0])
                if state is None or state in seen:
                    break
                seen.add(state)
            self._forced[start] = cached
        return cached


class OutlinesMatcher(GrammarMatcher):
    """A Guide over the shared Index plus the token history (copy = fresh Guide + replay)."""

    def __init__(self, grammar: OutlinesGrammar, guide: Any, history: list[int]) -> None:
        super().__init__(grammar.space)
        self._grammar = grammar
        self._guide = guide
        self._history = history

    def _fill_content(self, row_ptr: int) -> None:
        self._guide.write_mask_into(row_ptr, self._space.words, 4)

    def _can_end(self) -> bool:
        return self._grammar.can_end(self._guide.get_state())

    def _accept_content(self, token: int) -> bool:
        try:
            self._guide.advance(token, False)
        except ValueError:  # no transition: the guide keeps its state
            return False
        self._history.append(token)
        return True

    def _rollback_content(self, k: int) -> None:
        assert k <= len(self._history)
        self._guide.rollback_state(k)
        del self._history[len(self._history) - k :]

    def _forced_content(self) -> list[int]:
        return self._grammar.forced_from(self._guide.get_state())

    def _clone(self) -> GrammarMatcher:
        guide = outlines_core.Guide(self._grammar.index, max_rollback=MAX_ROLLBACK)
        for token in self._history:
            guide.advance(token, False)
        return OutlinesMatcher(self._grammar, guide, list(self._history))


class _WorkerPool:
    """Compile worker processes (spawned lazily); one that overruns its timeout is killed."""

    def __init__(self, vocabulary: Any, size: int) -> None:
        self._vocabulary = vocabulary
        self._idle: list[subprocess.Popen[bytes]] = []
        self._slots = threading.Semaphore(size)
        self._lock = threading.Lock()

    def build(self, job: tuple[str, str, str], timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        if not self._slots.acquire(timeout=timeout_s):
            raise GrammarError(f"{what} compile timed out after {timeout_s:g} s (all workers busy)")
        proc = None
        try:
            with self._lock:
                proc = self._idle.pop() if self._idle else self._spawn()
            assert proc.stdin is not None and proc.stdout is not None
            worker.write_frame(proc.stdin, job)
            reply = _read_frame(proc.stdout.fileno(), deadline)
            if reply is None:
                proc.kill()
                proc.wait()
                proc = None
                raise GrammarError(f"{what} compile timed out after {timeout_s:g} s")
            with self._lock:
                self._idle.append(proc)
            proc = None
            status, payload = reply
            if status != "ok":
                raise GrammarError(f"outlines cannot compile this {what}: {payload}")
            return pickle.loads(payload)
        finally:
            if proc is not None:  # died mid-job (or a pipe error): never reuse it
                proc.kill()
                proc.wait()
            self._slots.release()

    def close(self) -> None:
        with self._lock:
            for proc in self._idle:
                proc.kill()
                proc.wait()
            self._idle.clear()

    def _spawn(self) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-I", worker.__file__]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None
        worker.write_frame(proc.stdin, self._vocabulary)
        return proc


def _read_frame(fd: int, deadline: float) -> Any:
    """One reply frame from `fd`, or None if the deadline passes first."""
    header = _read_exact(fd, worker._HEADER.size, deadline)
    if header is None:
        return None
    body = _read_exact(fd, worker._HEADER.unpack(header)[0], deadline)
    return None if body is None else pickle.loads(body)


def _read_exact(fd: int, n: int, deadline: float) -> bytes | None:
    chunks: list[bytes] = []
    while n:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise GrammarError("outlines compile worker exited unexpectedly")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)

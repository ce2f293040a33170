"""Asynchronous grammar compilation for the scheduler: worker threads, a timeout, an LRU cache."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait

from weft.constrain.base import CompiledGrammar, GrammarBackend
from weft.constrain.errors import PROCESS_EXITS, GrammarError, failure_text
from weft.constrain.limits import DEFAULT_LIMITS, GrammarLimits
from weft.constrain.spec import GrammarSpec

logger = logging.getLogger(__name__)


class CompileHandle:
    """One compile, in flight or finished (shared by every request with the same spec).

    Poll `done()` from the scheduler loop; then `result()` returns the CompiledGrammar or raises
    GrammarError (unsupported, invalid, or "timed out after X s"). The clock starts when a worker
    picks the job up; a compile that overruns it counts as failed even if it finishes later.
    """

    def __init__(self, spec: GrammarSpec, timeout_s: float) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self._future: Future[CompiledGrammar] = Future()
        self._started: float | None = None
        self._elapsed: float | None = None

    def done(self) -> bool:
        return self._future.done() or self._overran()

    def result(self, wait_s: float | None = None) -> CompiledGrammar:
        """The compiled grammar; waits up to `wait_s` (None: until done). TimeoutError if not done."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while not self.done():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"grammar compile still running after {wait_s} s")
            expiry = None if self._started is None else self._started + self.timeout_s
            ends = [t for t in (deadline, expiry) if t is not None]
            wait([self._future], timeout=min(ends) - now + 0.001 if ends else 0.05)
        if self._overran():
            raise GrammarError(f"{self.spec.kind} compile timed out after {self.timeout_s:g} s")
        return self._future.result()

    @property
    def elapsed_s(self) -> float | None:
        """Compile wall time, once finished."""
        return self._elapsed

    def _overran(self) -> bool:
        if self._elapsed is not None:
            return self._elapsed > self.timeout_s
        return self._started is not None and time.monotonic() - self._started > self.timeout_s

    def _run(self, backend: GrammarBackend, limits: GrammarLimits) -> None:
        self._started = time.monotonic()
        try:
            limits.check(self.spec.kind, self.spec.spec)
            grammar = backend.compile(self.spec, timeout_s=self.timeout_s)
        except GrammarError as e:
            self._elapsed = time.monotonic() - self._started
            self._future.set_exception(e)
        except PROCESS_EXITS as e:  # interpreter exit: the caller still gets an answer
            self._elapsed = time.monotonic() - self._started
            self._future.set_exception(e)
            raise
        except BaseException as e:  # an assert, a Rust panic, a bug: this spec fails alone
            self._elapsed = time.monotonic() - self._started
            logger.exception("the %s grammar backend failed on a %s", backend.name, self.spec.kind)
            self._future.set_exception(
                GrammarError(
                    f"internal error in the {backend.name} grammar backend ({failure_text(e)})"
                )
            )
        else:
            self._elapsed = time.monotonic() - self._started
            self._future.set_result(grammar)


class GrammarCompiler:
    """Compiles specs off the caller's thread, caching results and failures by
    (backend, tokenizer, options, kind, canonical spec, strict) in an LRU of `cache_size` entries.
    Each spec is first checked against `limits` (a GrammarError names the limit). Whatever the
    backend raises fails that spec alone, as a GrammarError (only interpreter exits propagate).

    The timeout really bounds the work: the outlines backend kills its worker process at the
    deadline; llguidance compiles are bounded by the library's fuel limits (worst case ~2 s of
    work on one thread, whose late result is discarded).
    """

    def __init__(
        self,
        backend: GrammarBackend,
        timeout_s: float = 10.0,
        cache_size: int = 1024,
        threads: int = 2,
        limits: GrammarLimits = DEFAULT_LIMITS,
    ) -> None:
        assert timeout_s > 0 and cache_size > 0 and threads > 0
        self.backend = backend
        self.limits = limits
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self._cache: OrderedDict[tuple[object, ...], CompileHandle] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="weft-grammar")

    def submit(self, spec: GrammarSpec) -> CompileHandle:
        """Start compiling `spec` (or return the cached handle); never blocks on the compile."""
        key = (*self.backend.cache_key, spec.kind, spec.spec, spec.strict)
        with self._lock:
            handle = self._cache.get(key)
            if handle is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return handle
            self.misses += 1
            handle = self._cache[key] = CompileHandle(spec, self.timeout_s)
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        self._pool.submit(handle._run, self.backend, self.limits)
        return handle

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.backend.close()

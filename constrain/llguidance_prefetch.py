"""Mask prefetch for llguidance matchers: one background thread computing queued masks, a step's
masks at once on the library's thread pool (`MASK_WORKER.batch()`), others one by one in order."""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

Finish = Callable[[int], None]  # with the mask's address, once it is computed
Item = tuple[Any, "ctypes.Array[ctypes.c_int32]", Finish, "Job"]


class Job:
    """One mask computation: `done` is held until the worker has written the mask (a batch's
    job: until the mask is computed; its `finish` then runs in `wait`, on the waiting thread)."""

    __slots__ = ("done", "error", "_finish_here")

    def __init__(self) -> None:
        self.done = threading.Lock()
        self.done.acquire()
        self.error: BaseException | None = None
        self._finish_here: Callable[[], None] | None = None

    def wait(self) -> None:
        """Block until the mask is finished; raises the worker's error, if any."""
        self.done.acquire()
        if self.error is not None:
            raise self.error
        if self._finish_here is not None:
            finish, self._finish_here = self._finish_here, None
            finish()


class MaskWorker:
    """Daemon threads computing prefetched masks (started on first use: `num_workers` threads
    taking jobs from one queue).

    Each thread takes the next job in submission order, computes it and finishes it. With
    `batching`, the jobs a thread submits inside `batch()` are handed over together when it
    closes, computed in parallel by llguidance's executor (its own threads, without the GIL), and
    each is finished by the thread that waits for it (`Job.wait`). llguidance drops the GIL
    inside its mask computation, so the caller's thread runs meanwhile.
    NOTE: on the H200 host (16 cores, batch 32, 128k-token vocabulary) the p99 fill was 31.9 us
    with one thread, 24.3 with two and 5.0 with three (thirteenth session); 7 threads gave 325 us
    against 122 for one in the sixth (GIL contention). So `default_workers`: 3, fewer where
    the cores are fewer.
    """

    def __init__(self, num_threads: int | None = None) -> None:
        self._jobs: queue.SimpleQueue[list[Item]] = queue.SimpleQueue()
        self._started = False  # the worker threads
        self._start_lock = threading.Lock()
        self._held: list[Item] | None = None  # jobs of the open batch
        self._holder: int | None = None  # the thread that opened it
        self._num_threads = num_threads
        # batches are opt-in (WEFT_MASK_BATCH=1, for measuring): on the H200 host they cut the
        # median fill to 1.5 us but raised the p99 to 583 us (finished on this thread then);
        # finished by the waiters instead: p50 11.2, p99 46.1 us against 1.8 / 45.3 one by one
        # (a worker taking every queued job at once, tried: 1.8 / 78.0 us; BENCHMARKS.md,
        # eleventh and thirteenth sessions)
        batching = os.environ.get("WEFT_MASK_BATCH", "0")
        if batching not in ("0", "1"):
            raise ValueError(f"WEFT_MASK_BATCH must be 0 or 1, got {batching!r}")
        self.batching = batching == "1"
        # Python threads taking jobs (WEFT_MASK_THREADS overrides, for measuring)
        threads = os.environ.get("WEFT_MASK_THREADS", "")
        if threads and not threads.isdigit():
            raise ValueError(f"WEFT_MASK_THREADS must be a thread count, got {threads!r}")
        self.num_workers = max(1, int(threads)) if threads else default_workers()
        self._executor: Any = None  # llguidance.LLExecutor, built on the first batch

    @contextmanager
    def batch(self) -> Iterator[None]:
        """With `batching`, jobs this thread submits inside are computed together once it closes
        (nested: the outermost batch); else nothing changes."""
        if self._held is not None or not self.batching:
            yield
            return
        self._held, self._holder = [], threading.get_ident()
        try:
            yield
        finally:
            held, self._held, self._holder = self._held, None, None
            if held:
                self._put(held)

    def submit(self, matcher: Any, out: ctypes.Array[ctypes.c_int32], finish: Finish) -> Job:
        """Compute `matcher`'s next mask into `out`, then call `finish(address of out)`: on the
        worker thread, or in a batch on the thread that waits for the job (the job keeps all
        three alive until it is done)."""
        job = Job()
        if self._held is not None and self._holder == threading.get_ident():
            self._held.append((matcher, out, finish, job))
        else:
            self._put([(matcher, out, finish, job)])
        return job

    ##### Internal Helper Functions #####

    def _put(self, items: list[Item]) -> None:
        if not self._started:
            with self._start_lock:
                if not self._started:
                    for k in range(self.num_workers):
                        name = f"llg-mask-{k}"
                        threading.Thread(target=self._run, name=name, daemon=True).start()
                    self._started = True
        self._jobs.put(items)

    def _run(self) -> None:
        while True:
            items = self._jobs.get()
            if len(items) > 1:
                self._run_together(items)
            else:
                matcher, out, finish, job = items[0]
                try:
                    address = ctypes.addressof(out)
                    matcher.unsafe_compute_mask_ptr(address, ctypes.sizeof(out))
                    finish(address)
                except BaseException as e:  # noqa: BLE001 - handed to the matcher's thread
                    job.error = e
                finally:
                    job.done.release()
                del matcher, out, finish, job
            del items  # NOTE: drop references before the next jobs

    def _run_together(self, items: list[Item]) -> None:
        """The items' masks computed in parallel into a scratch block, their jobs released at
        once: each waiter copies its mask out and finishes it (this thread holds the GIL only
        briefly, so the scheduler's first fill does not wait for every other job's finish). On
        a library error, each mask alone, in place (so that an error lands on its own job)."""
        import llguidance

        size = ctypes.sizeof(items[0][1])
        with self._start_lock:  # NOTE: several workers may get here first together
            if self._executor is None:
                self._executor = llguidance.LLExecutor(self._num_threads)
        scratch = torch.empty(len(items) * size // 4, dtype=torch.int32)  # NOTE: uninitialised
        base = scratch.data_ptr()
        try:
            pairs = [(m, k) for k, (m, *_rest) in enumerate(items)]
            self._executor.unsafe_compute_mask_ptr(pairs, base, size, len(items))
        except BaseException:  # noqa: BLE001 - each one alone below
            base = 0
        for k, (m, out, finish, job) in enumerate(items):
            if base:
                job._finish_here = functools.partial(_land, base + k * size, scratch, out, finish)
            else:
                try:
                    m.unsafe_compute_mask_ptr(ctypes.addressof(out), size)
                    job._finish_here = functools.partial(finish, ctypes.addressof(out))
                except BaseException as e:  # noqa: BLE001 - handed to the matcher's thread
                    job.error = e
            job.done.release()


def _land(src: int, keep: torch.Tensor, out: ctypes.Array[ctypes.c_int32], finish: Finish) -> None:
    """On the waiting thread: a batch's mask (at `src` in the scratch block `keep`) into `out`,
    then finished."""
    del keep  # held only so that `src` stays valid until here
    ctypes.memmove(out, src, ctypes.sizeof(out))
    finish(ctypes.addressof(out))


def default_workers() -> int:
    """Mask worker threads: 3, leaving one core to the scheduler thread on smaller machines."""
    return max(1, min(3, (os.cpu_count() or 1) - 1))


MASK_WORKER = MaskWorker()


class BoundRow:
    """A matcher's prefetch buffer, and the bitmask row it owns (the request's slot; its last
    fill with bind): the worker also writes each finished mask there, so that a fill of that row
    waits and does not copy.

    `bind` (fill, no job in flight) and `release` (the runtime let the row go) run on the
    scheduler thread, `publish` on the worker; the lock orders them. NOTE: release never waits
    for a job in flight: the job's mask stays in `buffer`, and no write reaches the row after
    release returns (the row may already belong to another request).
    """

    def __init__(self, words: int) -> None:
        self.buffer = (ctypes.c_int32 * words)()  # the worker computes here, then publishes
        self._size = 4 * words
        self._lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None  # keeps the bound row's memory alive
        self._address = 0  # of the bound row; 0: none
        self._row = -1  # its index in _bitmask
        self.published = 0  # address of the row that holds `buffer`'s finished mask; 0: none

    def bind(self, bitmask: torch.Tensor | None, row: int, holds: bool) -> None:
        """The matcher was filled into `bitmask[row]` (`holds`: with `buffer`'s mask), which it
        now owns (None: a row it does not own; unbinds)."""
        if bitmask is None:
            self.release()
            return
        address = bitmask.data_ptr() + self._size * row
        with self._lock:
            self._bitmask, self._address, self._row = bitmask, address, row
            self.published = address if holds else 0

    def release(self) -> None:
        """Forget the bound row: from now on no job writes it."""
        with self._lock:
            self._bitmask, self._address, self._row, self.published = None, 0, -1, 0

    def holds(self, bitmask: torch.Tensor, row: int) -> bool:
        """Whether `bitmask[row]` is the bound row and holds `buffer`'s finished mask (read with
        no job in flight: the worker's last publish happened before its job was joined)."""
        return self._bitmask is bitmask and self._row == row and self.published != 0

    def publish(self) -> None:
        """On the worker, once `buffer` holds a finished mask: copy it into the bound row."""
        with self._lock:
            if self._address:
                ctypes.memmove(self._address, ctypes.addressof(self.buffer), self._size)
            self.published = self._address

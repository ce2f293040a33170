"""Mask prefetch for llguidance matchers: background threads computing queued masks in order."""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

Finish = Callable[[int], None]  # with the mask's address, once it is computed
Item = tuple[Any, "ctypes.Array[ctypes.c_int32]", Finish, "Job"]


class Job:
    """One mask computation: `done` is held until the worker has written the mask."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Lock()
        self.done.acquire()
        self.error: BaseException | None = None

    def wait(self) -> None:
        """Block until the mask is finished; raises the worker's error, if any."""
        self.done.acquire()
        if self.error is not None:
            raise self.error


class MaskWorker:
    """Daemon threads computing prefetched masks (started on first use: `num_workers` threads
    taking jobs from one queue, each the next job in submission order). llguidance drops the
    GIL inside its mask computation, so the caller's thread runs meanwhile.

    NOTE: on the H200 host (16 cores, batch 32, a 128k-token vocabulary) the p99 fill was 31.9 us
    with one thread, 24.3 with two and 5.0 with three; 7 threads gave 325 us against 122 for one
    (GIL contention) (`benchmarks/offline.py constrained --engine-arg tuning.grammar_mask_threads=N`: fill p50/p99). So
    `default_workers`: 3, fewer where the cores are fewer.
    """

    def __init__(self, num_workers: int | None = None) -> None:
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"MaskWorker: num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers or default_workers()
        self._jobs: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._started = False  # the worker threads
        self._start_lock = threading.Lock()

    def submit(self, matcher: Any, out: ctypes.Array[ctypes.c_int32], finish: Finish) -> Job:
        """Compute `matcher`'s next mask into `out`, then call `finish(address of out)` on the
        worker thread (the job keeps all three alive until it is done)."""
        if not self._started:
            with self._start_lock:
                if not self._started:
                    for k in range(self.num_workers):
                        name = f"llg-mask-{k}"
                        threading.Thread(target=self._run, name=name, daemon=True).start()
                    self._started = True
        job = Job()
        self._jobs.put((matcher, out, finish, job))
        return job

    ##### Internal Helper Functions #####

    def _run(self) -> None:
        while True:
            matcher, out, finish, job = self._jobs.get()
            try:
                address = ctypes.addressof(out)
                matcher.unsafe_compute_mask_ptr(address, ctypes.sizeof(out))
                finish(address)
            except BaseException as e:  # noqa: BLE001 - handed to the matcher's thread
                job.error = e
            finally:
                job.done.release()
            del matcher, out, finish, job  # NOTE: drop references before the next job


def default_workers() -> int:
    """Mask worker threads: 3, leaving one core to the scheduler thread on smaller machines."""
    return max(1, min(3, (os.cpu_count() or 1) - 1))


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

"""Mask prefetch for llguidance matchers: a background thread computing queued masks in batches."""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from typing import Any

import llguidance


class Job:
    """One mask computation: `done` is held until the worker has written the mask."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Lock()
        self.done.acquire()
        self.error: BaseException | None = None


def mask_threads(cpus: int) -> int:
    """Threads of the library's executor for a host of `cpus` usable cores: one on a small
    machine (the scheduler and the model need the rest), up to 8 on a large one, where 32+
    constrained requests each queue a mask per step."""
    return max(1, min(8, (cpus - 2) // 2))


class MaskWorker:
    """One daemon thread (started on first use) that takes the jobs queued so far, up to one per
    executor thread, and computes their masks in one call of the library's executor: in parallel
    on its own threads, without the GIL, then copied to each job's buffer. Each matcher has at
    most one job in flight. (One call for the whole queue made a fill wait for all of it: p99
    689 us on the H200 host at batch 32.)

    NOTE: one Python thread, not several: Python threads that each wake per mask contend for the
    GIL with the scheduler thread (measured on the H200 host: 7 threads took the scheduler's
    p99 fill from 122 to 325 us; see BENCHMARKS.md).
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._jobs: queue.SimpleQueue[tuple[Any, ctypes.Array[ctypes.c_int32], Job]] = (
            queue.SimpleQueue()
        )
        self._started = False
        self._start_lock = threading.Lock()
        self.batches = 0  # executor calls with more than one job (for tests)

    def submit(self, matcher: Any, out: ctypes.Array[ctypes.c_int32]) -> Job:
        """Compute `matcher`'s next mask into `out` (the job keeps both alive until it is done)."""
        if not self._started:
            with self._start_lock:
                if not self._started:
                    threading.Thread(target=self._run, name="llg-mask", daemon=True).start()
                    self._started = True
        job = Job()
        self._jobs.put((matcher, out, job))
        return job

    def _run(self) -> None:
        # one thread: each mask computed directly (the executor's handoff costs ~30 us per call
        # on a 2-core VM)
        executor = llguidance.LLExecutor(num_threads=self.threads) if self.threads > 1 else None
        while True:
            jobs = [self._jobs.get()]
            while len(jobs) < self.threads:  # NOTE: a round per thread count: jobs are released
                try:  # as each round ends, in queue order, so the first fills wait least
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            try:
                self._compute(executor, jobs)
            finally:
                for _, _, job in jobs:
                    job.done.release()
            del jobs  # NOTE: drop references before blocking on the next job

    def _compute(
        self, executor: Any, jobs: list[tuple[Any, ctypes.Array[ctypes.c_int32], Job]]
    ) -> None:
        if executor is not None and len(jobs) > 1:
            nbytes = ctypes.sizeof(jobs[0][1])
            arena = (ctypes.c_byte * (nbytes * len(jobs)))()
            base = ctypes.addressof(arena)
            try:
                executor.unsafe_compute_mask_ptr(
                    [(m, k) for k, (m, _, _) in enumerate(jobs)], base, nbytes, len(jobs)
                )
            except BaseException:  # noqa: BLE001 - one by one below, each with its own error
                pass
            else:
                self.batches += 1
                for k, (_, out, _) in enumerate(jobs):
                    ctypes.memmove(ctypes.addressof(out), base + k * nbytes, nbytes)
                return
        for matcher, out, job in jobs:
            try:
                matcher.unsafe_compute_mask_ptr(ctypes.addressof(out), ctypes.sizeof(out))
            except BaseException as e:  # noqa: BLE001 - handed to the matcher's thread
                job.error = e


MASK_WORKER = MaskWorker(mask_threads(len(os.sched_getaffinity(0))))

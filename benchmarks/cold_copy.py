"""What one mask-sized copy costs after a model step's worth of other work, on this CPU.

    OMP_NUM_THREADS=1 python benchmarks/cold_copy.py [--bytes 6144] [--reps 200]

The scheduler's fill of a prefetched grammar mask is one copy of a row (6 KB for SmolLM2's 49,152
ids). This times `ctypes.memmove` of a buffer of that size right after a busy gap of small torch
matmuls (standing for the model step between a mask's prefetch and its fill), with the source
written by another thread (as the prefetch worker does) or by the copying thread itself: if both
are slow after a long gap, the cost is the cold read, not the hand-over between cores.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import queue
import threading
import time

import torch


def busy(seconds: float, a: torch.Tensor) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=6144)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    words = args.bytes // 4
    a = torch.randn(256, 256)
    dst = (ctypes.c_int32 * words)()
    jobs: queue.SimpleQueue[ctypes.Array[ctypes.c_int32]] = queue.SimpleQueue()
    done: queue.SimpleQueue[int] = queue.SimpleQueue()

    def worker() -> None:
        while True:
            buf = jobs.get()
            ctypes.memset(ctypes.addressof(buf), 0x55, words * 4)
            done.put(1)

    threading.Thread(target=worker, daemon=True).start()
    print(f"load average {os.getloadavg()[0]:.2f}; {args.bytes} bytes, {args.reps} copies each")
    print("| source written by | busy gap | p50 µs | p90 µs | p99 µs |")
    print("|---|---|---|---|---|")
    for writer in ("another thread", "the same thread"):
        for gap_ms in (0.0, 1.0, 10.0):
            times = []
            for _ in range(args.reps):
                buf = (ctypes.c_int32 * words)()
                if writer == "the same thread":
                    ctypes.memset(ctypes.addressof(buf), 0x55, words * 4)
                else:
                    jobs.put(buf)
                    done.get()
                busy(gap_ms / 1e3, a)
                t0 = time.perf_counter_ns()
                ctypes.memmove(ctypes.addressof(dst), ctypes.addressof(buf), words * 4)
                times.append((time.perf_counter_ns() - t0) / 1e3)
            times.sort()
            n = len(times)
            print(f"| {writer} | {gap_ms:g} ms | {times[n // 2]:.1f} | {times[n * 9 // 10]:.1f} "
                  f"| {times[min(n - 1, n * 99 // 100)]:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
